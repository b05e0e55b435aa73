"""Double-buffered apply: make received weights live by re-pointing the params at them, no copy.

The params' storage alternates between two flat buffers laid out by the bucket plan: the *live*
one, which the params are views into, and the *spare* one, which the next update is received
into while generation goes on. Making an update live re-points every param at its view in the
freshly received buffer (``param.data = view``: the ``Parameter`` objects stay, so tied weights
and every module's reference to them hold) and the buffer that was live becomes the spare. The
pause is then a loop over the params instead of a copy of every byte.

Memory: the same as a staging buffer beside the model. The model's own storages are freed at the
first swap (unless something else holds them); from then on there are exactly two buffers.

Only a *full* update received into the buffer :meth:`DoubleBuffer.spare` handed out can swap
(every param, same dtype, shape and device). Anything else (a partial update, a buffer owned by
someone else) is copied into the live params by :func:`~pipelinerl_sdk.weights.receive.apply_staged`,
which is always correct. Not thread-safe; callers hold the engine paused (no forward running)
around :meth:`DoubleBuffer.apply`, as they would for a copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pipelinerl_sdk.weights.buckets import BucketPlan
from pipelinerl_sdk.weights.receive import StagedWeights, apply_staged


@dataclass(frozen=True, slots=True)
class Applied:
    """What :meth:`DoubleBuffer.apply` did: ``nbytes`` made live, by a swap or by a copy."""

    nbytes: int
    swapped: bool


class DoubleBuffer:
    """The two flat buffers of one model's weights: the live one (once a swap happened) and the
    spare one its next update is received into. The params stay the caller's; pass the same ones
    (the model's) to every :meth:`apply`, or the buffer deemed spare may still be live."""

    def __init__(self) -> None:
        self._live: torch.Tensor | None = None  # the buffer the params are views into, once swapped
        self._spare: torch.Tensor | None = None

    def spare(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer of ``nbytes`` to receive into: never the live one, reused across updates of
        the same size (fresh pages cost a first-touch fault on every byte)."""
        s = self._spare
        if s is None or s.numel() != nbytes or s.device != device:
            self._spare = s = None  # free a buffer of the wrong size before allocating
            self._spare = s = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return s

    def can_swap(self, staged: StagedWeights, params: Mapping[str, torch.Tensor]) -> bool:
        """True when ``staged`` covers every one of ``params`` exactly and lies in the spare buffer."""
        if self._spare is None or staged.buffer is not self._spare:
            return False
        covered = 0
        for name, view in staged.tensors():  # names are unique within a plan
            live = params.get(name)
            if live is None or live.dtype != view.dtype or live.shape != view.shape or live.device != view.device:
                return False
            covered += 1
        return covered == len(params)

    @torch.no_grad()
    def restage(self, params: Mapping[str, torch.Tensor], plan: BucketPlan) -> StagedWeights:
        """The live ``params`` copied into the spare buffer in ``plan``'s layout (``plan``: of
        exactly these params): a full update holding the weights served now, so that
        :meth:`apply` can be timed changing nothing. Reads the live params only: generation may
        go on meanwhile."""
        device = next(iter(params.values())).device
        staged = StagedWeights(plan, self.spare(plan.total_bytes, device), 0.0)
        for name, view in staged.tensors():
            view.copy_(params[name])
        return staged

    @torch.no_grad()
    def apply(self, staged: StagedWeights, params: Mapping[str, torch.Tensor]) -> Applied:
        """Make ``staged`` the live ``params`` (name -> live tensor): a swap when :meth:`can_swap`,
        else a copy."""
        if not self.can_swap(staged, params):
            return Applied(apply_staged(staged, params), swapped=False)
        nbytes = 0
        for name, view in staged.tensors():
            params[name].data = view
            nbytes += view.numel() * view.element_size()
        self._live, self._spare = staged.buffer, self._live
        return Applied(nbytes, swapped=True)
