"""The weight-update group's per-connect secret: what makes its decisions unforgeable.

The group's TCPStore has no authentication: anyone who reaches its port can read, list, write and
delete keys. So the trainer draws a random secret for every group it forms and hands it to each
server only over the control-token-guarded ``/init_process_group``. From it derive:

- the **group id** (:func:`group_id`), which every ``/request_weight_update`` must name: an update
  meant for another group (a replaced trainer's) is refused at once;
- the **store namespace** (:func:`store_name`): every key of the group (rendezvous and decisions)
  lives under a name nobody can guess before the group exists (the store lists its keys to anyone
  once they exist, so the rendezvous values are signed as well: :mod:`.signed_store`);
- the **signature** of every decision (:func:`sign_decision`): a receiver acts only on a ``go`` or
  ``abort`` signed with the secret; anything else in the decision's key is ignored (and logged).

An outsider who reaches the port can still delete or overwrite keys (a denial of service: the
update fails on its timeout and the old weights keep serving), but cannot make a server enter a
broadcast or call an update off. Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

#: Length in hex characters of a secret drawn by :func:`new_group_secret`.
SECRET_HEX = 64
_VERSION = "v1"


def new_group_secret() -> str:
    """A fresh random secret (hex) for one group."""
    return secrets.token_hex(SECRET_HEX // 2)


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(secret.encode(), "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def group_id(secret: str) -> str:
    """The public id of the group formed with ``secret`` (one-way: it reveals nothing of it)."""
    return hashlib.sha256(f"pipelinerl-group-id\0{secret}".encode()).hexdigest()[:32]


def store_name(group_name: str, secret: str) -> str:
    """The name the group's keys live under in the store (``group_name`` alone without a secret)."""
    return f"{group_name}.{_mac(secret, 'store', group_name)[:24]}" if secret else group_name


def sign_decision(secret: str, key: str, go: bool, reason: str = "") -> str:
    """The store value announcing ``go`` (or ``abort: reason``) for the transfer ``key``."""
    verb = "go" if go else "abort"
    return f"{_VERSION}:{verb}:{_mac(secret, _VERSION, key, verb, reason)}:{reason}"


def read_decision(secret: str, key: str, raw: bytes) -> tuple[bool, str] | None:
    """(go, reason) of a value :func:`sign_decision` wrote for ``key`` with ``secret``; None for
    anything else (unsigned, signed with another secret or for another key, malformed)."""
    text = raw.decode(errors="replace")
    version, _, rest = text.partition(":")
    verb, _, rest = rest.partition(":")
    mac, _, reason = rest.partition(":")
    if version != _VERSION or verb not in ("go", "abort"):
        return None
    if not hmac.compare_digest(mac, _mac(secret, _VERSION, key, verb, reason)):
        return None
    return verb == "go", reason
