"""The model a benchmark runs on: one given by the user, or the ``bench`` preset built offline."""

from __future__ import annotations

import os
from pathlib import Path


def bench_model(tmp: str | os.PathLike[str], model: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """(HF model directory, label for the report): ``model`` as given, or, if None, the ``bench``
    preset (~103 MB fp32) built into ``tmp/model`` (the caller owns ``tmp``)."""
    if model is not None:
        return Path(model), str(model)
    from pipelinerl_sdk.reference.tiny import build_tiny_model

    return build_tiny_model(Path(tmp, "model"), preset="bench"), "bench preset (built)"
