"""Version and group bookkeeping every inference server keeps: the weight version it serves and
the weight-update group as ``/info`` reports it, rebuilt from the init request it joined with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pipelinerl_sdk.errors import GroupError
from pipelinerl_sdk.protocol import GroupState, InitProcessGroupRequest, InitProcessGroupResponse
from pipelinerl_sdk.weights.auth import group_id

if TYPE_CHECKING:
    from pipelinerl_sdk.weights.group import WeightSyncGroup


class GroupBook:
    """What one server knows of its group and version. Not thread-safe: the router serialises
    control calls, and the kit's update runner is the only writer during an update.

    ``version`` is the weight version tagged on tokens generated from now on (0: initial weights);
    the update runner sets it once the new weights are live. A group is *broken* once a receive
    failed or timed out (gloo/NCCL cannot resume it): :meth:`mark_broken`, or the live
    :class:`~pipelinerl_sdk.weights.group.WeightSyncGroup` linked at :meth:`join` says so."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.request: InitProcessGroupRequest | None = None
        self.ranks: list[int] = []
        self._reason: str | None = None
        self._group: WeightSyncGroup | None = None

    def join(
        self, req: InitProcessGroupRequest, workers: int, group: WeightSyncGroup | None = None
    ) -> InitProcessGroupResponse:
        """Record a joined group: this server's ``workers`` take ranks ``rank_offset ..
        rank_offset + workers - 1``; ``group`` is the in-process member, if any. Returns the
        route's answer."""
        self.request, self._reason, self._group = req, None, group
        self.ranks = list(range(req.rank_offset, req.rank_offset + workers))
        return InitProcessGroupResponse(
            group_name=req.group_name,
            group_id=group_id(req.group_secret),
            ranks=self.ranks,
            world_size=req.world_size,
            backend=req.backend,
        )

    def leave(self) -> InitProcessGroupRequest | None:
        """Forget the group (before joining another); returns the request it was joined with."""
        old, self.request, self._group, self._reason, self.ranks = self.request, None, None, None, []
        return old

    @property
    def group(self) -> WeightSyncGroup | None:
        """The in-process group member linked at :meth:`join`, if any."""
        return self._group

    @property
    def broken(self) -> str | None:
        """Why the group is unusable, or None while it is healthy (or absent)."""
        return self._reason or (self._group.broken if self._group is not None else None)

    def mark_broken(self, reason: str) -> None:
        """The first reason sticks; a no-op without a group."""
        if self.request is not None and self.broken is None:
            self._reason = reason

    @contextmanager
    def breaking(self) -> Iterator[None]:
        """A :class:`GroupError` escaping the block (a failed or timed-out collective, no
        decision in time) marks the group broken, then propagates."""
        try:
            yield
        except GroupError as e:
            self.mark_broken(str(e))
            raise

    def state(self) -> GroupState | None:
        """``InferenceBackend.group_state()``: None until a group was joined."""
        req = self.request
        if req is None:
            return None
        reason = self.broken
        return GroupState(
            group_name=req.group_name,
            group_id=group_id(req.group_secret),
            ranks=list(self.ranks),
            world_size=req.world_size,
            backend=req.backend,
            broken=reason is not None,
            reason=reason,
        )
