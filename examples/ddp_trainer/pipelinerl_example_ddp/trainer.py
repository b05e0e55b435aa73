"""torch DistributedDataParallel as a pipelinerl-sdk trainer: only what is DDP's.

The trainer kit (:mod:`pipelinerl_sdk.kit.trainer`) does the rest: the process group (the
launcher's, or a private 1-rank one), AdamW, forward/backward with the idle pass for ranks
without sequences, the step with global-norm clipping, gathering, ``state_dict_hf`` and close.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from pipelinerl_example_ddp.plugin import CAPABILITIES
from pipelinerl_sdk.contracts import TrainerSpec
from pipelinerl_sdk.hf import load_model
from pipelinerl_sdk.kit.trainer import KitTrainer


class DDPTrainer(KitTrainer):
    capabilities = CAPABILITIES

    def __init__(self) -> None:
        super().__init__()
        self._hf = torch.nn.Module()

    def build_model(self, spec: TrainerSpec) -> DistributedDataParallel:
        model, _ = load_model(spec.model, dtype=spec.dtype, device=self.device)
        model.train()
        self._hf = model  # the weights, under HF names; DDP's wrapper adds ``module.``
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def hf_module(self) -> torch.nn.Module:
        return self._hf

    def backward_loss(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over ranks; the contract sums the loss over ranks.
        (loss * self.world_size).backward()  # type: ignore[no-untyped-call]
