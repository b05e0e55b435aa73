"""Run by ``torchrun`` from test_fast_llm_trainer.py: the Qwen2 job of that module on every rank;
rank 0 saves its final gathered weights to ``out`` (argv[1] is a JSON object with model and out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from test_fast_llm_trainer import BACKEND, _spec

from pipelinerl_sdk.testing.ranks import Job, Run, train
from pipelinerl_sdk.trainer_group import init_from_env

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    ctx = init_from_env("gloo")
    (out,) = train(ctx, Job((Run(BACKEND, _spec(Path(args["model"]))),)))
    if ctx.is_main:
        torch.save(out["final"], args["out"])
    dist.destroy_process_group()
