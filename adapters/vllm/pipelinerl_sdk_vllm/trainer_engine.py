"""The trainer side of vLLM's ``pipelinerl`` weight transfer, as a vLLM 0.32 trainer engine: a
trainer written for vLLM's ``WeightTransferTrainerFactory`` updates any SDK server (reference,
sglang, dynamo, vllm) through vLLM's own routes, and vLLM's own server started with
``--weight-transfer-config '{"backend": "pipelinerl"}'`` (this adapter's worker engine)::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from pipelinerl_sdk.http.vllm_flow import ControlTokenClient
    from pipelinerl_sdk_vllm.trainer_engine import PipelineRLTrainerInitInfo

    client = ControlTokenClient(url, control_token)  # or vLLM's HTTPVLLMWeightSyncClient(url)
    engine = WeightTransferTrainerFactory.trainer_init(
        PipelineRLTrainerInitInfo(world_size=2, rank=0), client=client, source=ModuleSource(model)
    )
    ...  # each step
    engine.send_weights()  # version 1, 2, ...: every token the server makes after it carries it

The data plane is the SDK's group (gloo on CPU, NCCL on GPU; ``group_backend``), with the SDK's
sender: ``go`` only once the server armed its receive (a refusal costs no byte), bucketed
broadcasts, a failed send leaving the old weights serving. Importing this module registers the
engine under ``pipelinerl`` (as does the adapter's ``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from pipelinerl_sdk.http.vllm_flow import VLLMFlowLink, VLLMFlowPublisher
from pipelinerl_sdk.protocol import ParamSpec
from pipelinerl_sdk.weights.buckets import DEFAULT_BUCKET_BYTES

__all__ = ["PipelineRLTrainerInitInfo", "PipelineRLTrainerWeightTransferEngine", "register_trainer_engine"]

BACKEND_NAME = "pipelinerl"


@dataclass
class PipelineRLTrainerInitInfo(TrainerInitInfo):
    """``world_size``: the trainer's sender (rank 0) plus every inference worker that joins
    (a server's ``GET /get_world_size`` each); the group's store listens on ``host:port`` (0:
    a port the system picks, held from the start). ``first_version`` is the version the first
    :meth:`~PipelineRLTrainerWeightTransferEngine.send_weights` publishes, each next one adds 1.
    ``signed_rendezvous``: only where every server's ``/info`` says so."""

    backend: ClassVar[str] = BACKEND_NAME

    world_size: int
    host: str = "127.0.0.1"
    port: int = 0
    group_backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    first_version: int = 1
    signed_rendezvous: bool = False


class PipelineRLTrainerWeightTransferEngine(TrainerWeightTransferEngine[PipelineRLTrainerInitInfo]):
    """vLLM's trainer engine contract over :class:`~pipelinerl_sdk.http.vllm_flow.VLLMFlowPublisher`.
    Rank 0 sends; other trainer ranks only iterate the source (its gathers are collectives)."""

    init_info_cls = PipelineRLTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None, is_sender: bool = True
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.flow: VLLMFlowPublisher | None = None
        #: The version the next :meth:`send_weights` publishes.
        self.next_version = 1

    @classmethod
    def trainer_init(
        cls,
        init_info: PipelineRLTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("pipelinerl trainer weight transfer requires a WeightSource")
        if init_info.world_size < 2:
            raise ValueError(f"world_size: the sender and at least one worker, got {init_info.world_size}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.next_version = init_info.first_version
        if not engine.is_sender:
            return engine
        link = VLLMFlowLink(
            client, receiving_workers=init_info.world_size - 1, signed_rendezvous=init_info.signed_rendezvous
        )
        engine.flow = VLLMFlowPublisher([link], bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s)
        engine.flow.connect(host=init_info.host, port=init_info.port, backend=init_info.group_backend)
        return engine

    def send_weights(self) -> None:
        """Publish the source's weights as :attr:`next_version` (then add 1). Raises what the
        publisher raises (FanOutError naming the refusing or failing server): the version is not
        spent then, and the old weights keep serving."""
        assert self.source is not None
        source = self.source
        if not self.is_sender:
            for _ in source:  # the gathers are collectives: every rank iterates
                pass
            return
        assert self.flow is not None, "trainer_init() first"
        params = [
            ParamSpec.model_validate({"name": m.name, "dtype": _dtype_name(m.dtype), "shape": tuple(m.shape)})
            for m in source.metadata()
        ]
        self.flow.publish(self.next_version, params, iter(source))
        self.next_version += 1

    def shutdown(self) -> None:
        if self.flow is not None:
            self.flow.close()
            self.flow = None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def register_trainer_engine() -> None:
    """Register :class:`PipelineRLTrainerWeightTransferEngine` as vLLM's trainer engine
    ``pipelinerl`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND_NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, PipelineRLTrainerWeightTransferEngine)


register_trainer_engine()
