"""A trainer that dies mid-broadcast (the suite runs it as a child and lets it SIGKILL itself).

``python -m pipelinerl_sdk.conformance._killed_sender URL MODEL_DIR DTYPE VERSION TIMEOUT_S``
with the control token in ``PIPELINERL_CONTROL_TOKEN``. It perturbs the weights (so a receiver
that applied anything would change its outputs), sends about half of the params in small buckets,
prints ``killing`` and kills itself with SIGKILL: no clean-up, no goodbye.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from pipelinerl_sdk.conformance.mirror import Mirror
from pipelinerl_sdk.http.client import InferenceClient
from pipelinerl_sdk.weights.publisher import WeightPublisher


class _DieHalfway:
    def __init__(self, sink: object, after: int) -> None:
        self._sink, self._after, self._sent = sink, after, 0

    def send(self, name: str, tensor: object) -> None:
        self._sink.send(name, tensor)  # type: ignore[attr-defined]
        self._sent += 1
        if self._sent == self._after:
            print("killing", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


async def main(url: str, model: str, dtype: str, version: int, timeout_s: float) -> None:
    mirror = Mirror(Path(model), dtype)
    mirror.perturb(seed=version + 1000, scale=0.5)
    client = InferenceClient(url, control_token=os.environ["PIPELINERL_CONTROL_TOKEN"])
    specs = (await client.info()).params
    publisher = WeightPublisher([client], bucket_bytes=4096, timeout_s=timeout_s)
    await publisher.connect()
    async with publisher.update(version, specs) as sink:
        await asyncio.to_thread(mirror.send_all, _DieHalfway(sink, max(1, len(specs) // 2)), specs)


if __name__ == "__main__":
    url, model, dtype, version, timeout_s = sys.argv[1:6]
    asyncio.run(main(url, model, dtype, int(version), float(timeout_s)))
