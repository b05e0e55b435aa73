"""``pipelinerl bench pipeline``: the same task, seed and backends in pipeline mode and in
conventional mode, one after the other; the figure is wall time to the reward target in pipeline
mode over the same in conventional mode (the paper reports about 2x, i.e. ~0.5)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipelinerl_sdk.pipeline.config import PipelineConfig
from pipelinerl_sdk.pipeline.run import run_pipeline


def run_pipeline_bench(config: str | None, overrides: list[str], out_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mode in ("pipeline", "conventional"):
        cfg = PipelineConfig.load(
            config, [*overrides, f"mode={mode}", f"out_dir={Path(out_dir) / mode}", "progress=false"]
        )
        results[mode] = asdict(run_pipeline(cfg))
    p, c = results["pipeline"], results["conventional"]
    ratio = (
        p["time_to_target_s"] / c["time_to_target_s"]
        if p["reached_target"] and c["reached_target"] and c["time_to_target_s"]
        else None
    )
    return {
        "time_to_target_ratio": ratio,
        "target": 0.6,
        "meets_target": ratio is not None and ratio <= 0.6,
        "pipeline": p,
        "conventional": c,
    }
