"""A store view whose every value is signed with the group's secret: the rendezvous unforgeable.

The group's TCPStore has no authentication, and anyone who reaches its port can list its keys
(``list_keys``), so the secret namespace alone does not hide the rendezvous: an outsider could
overwrite a member's address while the group forms and take that member's place in the group.
Through :class:`SignedStore` every value a member writes carries an HMAC of its key and bytes
under the secret, and every value a member reads must carry one: a value written by anyone
without the secret ends the read with :class:`~pipelinerl_sdk.errors.GroupError` naming the key
(the group does not form; the old weights keep serving). Counters (``add``) pass through
unsigned: their value is the store's own arithmetic; a forged count can only stall a formation.

Every member must form over the same view, so a group is signed only when every server says it
signs (``ServerInfo.signed_rendezvous``): its workers join through the SDK's
:class:`~pipelinerl_sdk.weights.group.WeightSyncGroup`, or an engine that forms the group with its
own call does it over this view (SGLang's adapter arms torch's ``tcp://`` rendezvous inside
SGLang's scheduler: ``pipelinerl_sdk_sglang.scheduler_hooks.sign_rendezvous``). An engine that
forms with plain values cannot join a signed group, and the trainer then forms unsigned.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from typing import Any

import torch.distributed as dist

from pipelinerl_sdk.errors import GroupError

#: Bytes of the HMAC-SHA256 tag in front of every signed value.
TAG_BYTES = 32


def _tag(secret: bytes, key: str, value: bytes) -> bytes:
    return hmac.new(secret, b"rendezvous\0" + key.encode() + b"\0" + value, hashlib.sha256).digest()


def signed_value(secret: str, key: str, value: bytes) -> bytes:
    """What :class:`SignedStore` stores for ``value`` at ``key`` (the full key, prefixes included)."""
    return _tag(secret.encode(), key, value) + value


def verified_value(secret: str, key: str, raw: bytes) -> bytes:
    """The value :func:`signed_value` made of ``raw``; GroupError naming ``key`` for anything else."""
    tag, value = raw[:TAG_BYTES], raw[TAG_BYTES:]
    if len(raw) < TAG_BYTES or not hmac.compare_digest(tag, _tag(secret.encode(), key, value)):
        raise GroupError(
            f"the group's store holds a value for {key!r} not written by a member (no valid signature): "
            "someone else reached the store while the group formed"
        )
    return value


class SignedStore(dist.Store):  # type: ignore[misc,name-defined]
    """``inner`` (a TCPStore) with every ``set`` signed and every ``get`` verified under
    ``secret`` (non-empty); the other operations pass through. torch's backends (gloo's and
    NCCL's rendezvous) call it like any store."""

    def __init__(self, inner: Any, secret: str) -> None:
        if not secret:
            raise ValueError("secret: a signed store needs the group's secret")
        super().__init__()
        self._inner, self._secret = inner, secret

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, signed_value(self._secret, key, data))

    def get(self, key: str) -> bytes:
        return verified_value(self._secret, key, bytes(self._inner.get(key)))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        raise GroupError(f"compare_set({key!r}) on a signed store: torch's group backends do not use it")
