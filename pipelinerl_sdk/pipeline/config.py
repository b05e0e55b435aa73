"""The typed configuration of a run: a TOML/JSON file, overridden by ``--set key=value``."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PipelineConfig(BaseModel):
    """Every knob of ``pipelinerl run``. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    #: ``pipeline`` overlaps generation and training (lag bounded by ``max_lag``);
    #: ``conventional`` generates a batch with fixed weights, trains, updates, repeats.
    mode: Literal["pipeline", "conventional"] = "pipeline"
    task: str = "digit-successor"
    #: HF model dir; empty = the task's built-in base model, built into ``out_dir/base-model``.
    model: str = ""
    inference_backend: str = "reference"
    #: Servers to use instead of launching ``num_servers`` of ``inference_backend``.
    server_urls: list[str] = Field(default_factory=list)
    control_token: str | None = None
    num_servers: Annotated[int, Field(ge=1, le=64)] = 1
    server_options: dict[str, str] = Field(default_factory=lambda: {"threads": "1", "max_batch_size": "64"})
    trainer_backend: str = "reference"
    trainer_threads: Annotated[int, Field(ge=1)] = 1
    #: Trainer ranks started by spawn (under ``torchrun`` the launcher's world size is used).
    trainer_world_size: Annotated[int, Field(ge=1, le=1024)] = 1
    #: Where trainer rank 0 hosts the weight-update group (an address the servers reach).
    group_host: str = "127.0.0.1"
    group_backend: Literal["gloo", "nccl"] = "gloo"
    receive_mode: Literal["staged", "direct"] | None = None

    group_size: Annotated[int, Field(ge=2, le=128)] = 16
    groups_per_step: Annotated[int, Field(ge=1)] = 8
    micro_batch_groups: Annotated[int, Field(ge=1)] = 8
    #: In optimizer steps: no sample trained at step k comes from weights older than k - max_lag.
    max_lag: Annotated[int, Field(ge=0)] = 2
    #: Concurrent generation requests (each one group of ``group_size`` samples).
    actors: Annotated[int, Field(ge=1)] = 8
    max_tokens: Annotated[int, Field(ge=1)] = 8
    temperature: Annotated[float, Field(gt=0)] = 1.0

    lr: Annotated[float, Field(gt=0)] = 1e-4
    grad_clip: float | None = 1.0
    normalize_std: bool = True
    kl_coef: Annotated[float, Field(ge=0)] = 0.0

    max_steps: Annotated[int, Field(ge=1)] = 2000
    max_seconds: Annotated[float, Field(gt=0)] = 600.0
    #: Stop once the moving mean reward (over ``target_window`` steps) reaches this.
    reward_target: float | None = 0.9
    target_window: Annotated[int, Field(ge=1)] = 20
    seed: int = 0
    out_dir: str = "runs/pipeline"
    progress: bool = True
    plots: bool = True

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if self.mode == "conventional" and self.max_lag != 0:
            # conventional = the same loop with no overlap: nothing is generated while training
            self.max_lag = 0
        if self.server_urls and self.control_token is None:
            raise ValueError("control_token: required with server_urls (the servers' control token)")
        if self.plots and importlib.util.find_spec("matplotlib") is None:  # fail now, not after the run
            raise ValueError("plots: matplotlib is not installed (pip install 'pipelinerl-sdk[plots]'; or plots=false)")
        return self

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] | None = None) -> PipelineConfig:
        """Read ``path`` (``.toml`` or ``.json``; None = defaults), then apply ``key=value``
        overrides (values parsed as JSON when they parse, else taken as strings)."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            text = p.read_text()
            data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
            try:
                data[key] = json.loads(raw)
            except json.JSONDecodeError:
                data[key] = raw
        return cls.model_validate(data)
