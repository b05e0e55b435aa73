"""The two contracts every backend implements, and the capabilities it declares.

``InferenceBackend`` is the *server-side* SPI: an object living in the inference server's
process, behind the HTTP router of :mod:`pipelinerl_sdk.http`. Clients never see it; they speak
the HTTP contract. ``TrainerBackend`` runs in every rank of the trainer, SPMD: every rank calls
every method in the same order (they contain collectives).

Nothing here imports torch or an engine at run time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pipelinerl_sdk.errors import InvalidRequest, UpdateRejected
from pipelinerl_sdk.protocol import (
    ApplyFloorResponse,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    GroupBackend,
    GroupState,
    InitProcessGroupRequest,
    InitProcessGroupResponse,
    ParamSpec,
    ProbeBroadcastRequest,
    ReceiveMode,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    WeightUpdateRequest,
    WorkerState,
)

if TYPE_CHECKING:
    import torch

# --- capabilities ---------------------------------------------------------------------------------


#: vLLM 0.32's ``--logprobs-mode`` values: what every reported logprob (and top alternative) is.
#: ``raw_logprobs`` (the default, what the trainer's importance ratios need): ``log_softmax`` of the
#: model's logits; ``raw_logits``: those logits; ``processed_logprobs``: ``log_softmax`` of the logits
#: the token was drawn from (bias and penalties applied, then temperature, min-p, top-k and top-p,
#: the tokens they cut at -9999); ``processed_logits``: those logits. Greedy requests: the processed
#: logits are the biased and penalised ones, unscaled.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True, slots=True)
class InferenceCapabilities:
    """What an inference backend declares once; the conformance suite turns each field into a
    requirement (a missing one is a skip with this backend's name and the field in the reason)."""

    receive_modes: frozenset[ReceiveMode] = frozenset({"direct"})
    group_backends: frozenset[GroupBackend] = frozenset({"gloo"})
    #: Requests running when an update arrives finish, later tokens tagged with the new version.
    in_flight_updates: bool = True
    #: Every completion token carries the weight version that computed it. Not optional: the
    #: wire type requires ``weight_versions`` and the loop's lag control reads it; only True.
    per_token_versions: bool = True
    prompt_logprobs: bool = False
    top_logprobs: bool = False
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16"})
    #: ``stop`` strings cut the text as vLLM does (before the stop string, the token kept), and
    #: ``stop_token_ids`` end a completion as vLLM does (with ``ignore_eos`` too).
    stop_strings: bool = False
    #: ``min_tokens`` holds the end off as vLLM does (stop and end-of-sequence ids masked for that
    #: many tokens, stop strings counted only past their text); without it a non-zero
    #: ``min_tokens`` is a 400 naming it (the SDK's router answers it).
    min_tokens: bool = False
    #: ``logit_bias`` is added to the logits before sampling (greedy included).
    logit_bias: bool = False
    #: ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` with vLLM's rules.
    penalties: bool = False
    #: ``top_k`` and ``min_p`` cut the distribution as vLLM does: after the temperature.
    sampling_filters: bool = False
    #: A request's ``seed`` fixes its samples: the same seeded request gives the same tokens on
    #: this server (whatever runs beside it), and two seeds give different ones.
    seeds: bool = False
    #: ``stream=true`` chat (server-sent events, :meth:`InferenceBackend.chat_completion_stream`).
    streaming: bool = False
    #: ``/v1/completions`` with the contract's extensions (:meth:`InferenceBackend.completion`).
    completions: bool = False
    #: Chat text constrained as asked: ``response_format`` ``json_object`` / ``json_schema``,
    #: ``tool_choice`` ``required`` or a named function (the text becomes ``tool_calls``).
    structured_outputs: bool = False
    #: The ``--logprobs-mode`` settings (vLLM 0.32's meanings, :data:`LOGPROBS_MODES`) a server of
    #: this backend can be started with; any other is refused at start-up, naming the setting.
    logprobs_modes: frozenset[str] = frozenset({"raw_logprobs"})
    #: vLLM 0.32's RL API (``/init_weight_transfer_engine``, ``/start_weight_update``,
    #: ``/update_weights``, ``/finish_weight_update``...) served by the SDK's router onto the SDK's
    #: update path (:mod:`pipelinerl_sdk.http.vllm_rl`). False where the engine's app keeps routes
    #: of its own at those paths (vLLM's).
    vllm_rl_api: bool = True
    #: vLLM 0.32's ``/pause?mode=keep``, ``/resume``, ``/is_paused`` on the vLLM front: a client
    #: holds generation (requests in flight frozen, kept) until it resumes, updates running inside
    #: the hold (:meth:`InferenceBackend.generation_hold`).
    pause_generation: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.logprobs_modes) - set(LOGPROBS_MODES)
        if unknown or "raw_logprobs" not in self.logprobs_modes:
            raise ValueError(
                f"logprobs_modes: {sorted(self.logprobs_modes)} (raw_logprobs and any of {LOGPROBS_MODES})"
            )
        if self.per_token_versions is not True:
            raise ValueError(
                "per_token_versions: must be True (every completion token carries its weight version: "
                "the chat response's weight_versions field is required by the protocol)"
            )


def capabilities_to_dict(caps: InferenceCapabilities | TrainerCapabilities) -> dict[str, Any]:
    """JSON-ready form: frozensets become sorted lists."""
    return {f: sorted(v) if isinstance(v, frozenset) else v for f, v in ((f, getattr(caps, f)) for f in caps.__slots__)}


def inference_capabilities_from_dict(data: Mapping[str, Any]) -> InferenceCapabilities:
    """Inverse of :func:`capabilities_to_dict`; unknown keys are ignored, missing ones default."""
    known = set(InferenceCapabilities.__slots__)
    kwargs: dict[str, Any] = {k: frozenset(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
    return InferenceCapabilities(**kwargs)


@dataclass(frozen=True, slots=True)
class TrainerCapabilities:
    """What a trainer backend declares once (see :class:`InferenceCapabilities`)."""

    #: Parameters are sharded across ranks (ZeRO-3, FSDP); False for replicated (DDP-style).
    sharded: bool = False
    #: The largest trainer group (``torch.distributed`` world size) the backend runs in; None means
    #: no limit of its own (any world size the launcher starts). The conformance suite runs the
    #: world-size-2 checks only when this is None or at least 2.
    max_world_size: int | None = None
    group_backends: frozenset[GroupBackend] = frozenset({"gloo"})
    dtypes: frozenset[str] = frozenset({"float32"})


# --- inference --------------------------------------------------------------------------------


#: Admission defaults of a server (``ServeConfig``): a 16 MiB body holds a prompt far past any
#: context and the param list of the largest model; 256 requests and 2^20 tokens keep a GPU busy.
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_MAX_TOKENS_IN_FLIGHT = 1 << 20


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """How ``pipelinerl serve`` starts a server. Control routes need ``control_token`` (distinct
    from ``api_key``, which guards the OpenAI routes when set). ``options`` are backend-specific
    (``--option key=value``)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    control_token: str = ""
    api_key: str | None = None
    receive_mode: ReceiveMode | None = None
    ready_file: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)
    #: Hosts besides loopback whose store ``/init_process_group`` may join (``init_method``);
    #: ``pipelinerl serve --allow-trainer-host HOST``.
    trainer_hosts: tuple[str, ...] = ()
    #: Request bodies past this many bytes are refused with 413 before they are parsed.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Chat requests admitted at once (running or queued in the engine); past it: 429.
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    #: Completion tokens the admitted chat requests may still generate (``n`` x token budget,
    #: summed); past it: 429. A request whose own budget is past it: 400 naming ``max_tokens``/``n``.
    max_tokens_in_flight: int = DEFAULT_MAX_TOKENS_IN_FLIGHT
    #: On SIGTERM, requests still running after this many seconds are aborted; the process exits
    #: a few seconds later at most (a receive stuck in a collective included).
    shutdown_timeout_s: float = 5.0
    #: The names ``/v1/models`` lists and requests may name (vLLM's ``--served-model-name``; the
    #: first is the one responses carry). Empty: the model directory's last component, which
    #: requests may also give as the whole path.
    served_model_names: tuple[str, ...] = ()
    #: Every logprob's ``token`` is ``token_id:N``, whatever the request asks (vLLM's
    #: ``--return-tokens-as-token-ids``; a request may still ask for it where this is off).
    return_tokens_as_token_ids: bool = False
    #: What every reported logprob is (vLLM's ``--logprobs-mode``, :data:`LOGPROBS_MODES`); a mode
    #: the backend does not declare in ``InferenceCapabilities.logprobs_modes`` is refused at start-up.
    logprobs_mode: str = "raw_logprobs"
    #: PipelineRL's trainer protocol (``/receive_weight_update``) over its group at this init
    #: method (``--weight-update-group-init-method``; None: not served), of this world size, as
    #: actor ``pipelinerl_actor_idx`` taking ``pipelinerl_local_ranks`` ranks
    #: (:mod:`pipelinerl_sdk.http.pipelinerl_trainer`).
    pipelinerl_group_init_method: str | None = None
    pipelinerl_group_world_size: int = 2
    pipelinerl_actor_idx: int = 0
    pipelinerl_local_ranks: int = 1


@dataclass(frozen=True, slots=True)
class UpdateReport:
    """What a completed update reports; all times in seconds."""

    version: int
    mode: ReceiveMode
    #: Generation was held this long (the number the design minimises).
    pause_s: float
    receive_s: float
    apply_s: float
    total_s: float
    #: The phases the backend observed (``protocol.SERVER_PHASES`` and engine-specific ones), by
    #: name without the ``at_`` prefix: ``time.time()`` stamps.
    stamps: Mapping[str, float] = field(default_factory=dict)

    def timings(self) -> dict[str, float]:
        """The ``done`` event's ``timings``: the durations, then each stamp as ``at_<phase>``."""
        return {
            "pause_s": self.pause_s,
            "receive_s": self.receive_s,
            "apply_s": self.apply_s,
            "total_s": self.total_s,
            **{f"at_{k}": v for k, v in self.stamps.items()},
        }


class GenerationHoldLike(Protocol):
    """A client's hold on generation (:class:`pipelinerl_sdk.kit.inference.hold.GenerationHold`):
    ``hold()`` returns once generation is held (requests in flight frozen, new ones waiting; at
    once if held), ``release()`` once it runs again; ``held`` says which."""

    @property
    def held(self) -> bool: ...

    async def hold(self) -> None: ...

    async def release(self) -> None: ...


class InferenceBackend(ABC):
    """An inference engine serving the inference contract in its own process.

    Lifecycle: ``start()`` once before any other coroutine, ``stop()`` once at the end. The router
    serialises control calls: at most one ``init_process_group``/``update_weights``/``probe`` runs at
    a time, and a second one is refused (409) rather than queued. ``chat_completion`` runs
    concurrently with everything, updates included.

    Update semantics the backend owns (the conformance suite checks each):
    - ``update_weights`` is called only after :meth:`validate_update` passed; it calls
      ``on_accepted()`` once its receive is armed (before waiting for the trainer's decision), so
      the trainer knows it may broadcast;
    - it returns once the new weights are live and every later token carries ``req.version``;
    - on any failure it raises, and then the old weights are still serving, generation is not
      paused, and nothing of the update is visible. Requests in flight are never dropped.

    Errors answer through one table (``pipelinerl_sdk.http.server.ERROR_STATUS``): raise
    :class:`~pipelinerl_sdk.errors.InvalidRequest` / ``PromptTooLong`` (400, naming the field) for
    a request you cannot serve; any other exception is a JSON 500, never a plain-text one.
    :mod:`pipelinerl_sdk.kit.inference` implements everything here that is not engine-specific.
    """

    #: The capabilities the backend registered (one constant: the registry checks they agree).
    capabilities: InferenceCapabilities = InferenceCapabilities()

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @property
    @abstractmethod
    def name(self) -> str:
        """The registered backend name (``reference``, ``vllm``...)."""

    @property
    @abstractmethod
    def model_name(self) -> str: ...

    @property
    @abstractmethod
    def version(self) -> int:
        """The weight version every newly generated token is tagged with (0 = initial weights)."""

    @property
    def max_model_len(self) -> int | None:
        """Context length: a request whose prompt plus ``max_tokens`` exceeds it is refused (4xx).
        ``None`` declares no limit."""
        return None

    @property
    @abstractmethod
    def receiving_workers(self) -> int:
        """How many ranks this server contributes to the weight-update group."""

    @abstractmethod
    def param_specs(self) -> list[ParamSpec]:
        """The params an update must carry, under HF names, in the server's dtype."""

    @property
    def signs_rendezvous(self) -> bool:
        """Whether this server's workers sign and verify every rendezvous value when the
        invitation asks (``/info``'s ``signed_rendezvous``; see
        :mod:`pipelinerl_sdk.weights.signed_store`): they join through the SDK's
        ``WeightSyncGroup``, or the engine's own group call runs over a ``SignedStore``. Default
        False: an engine that forms the group with its own code reads plain values."""
        return False

    def worker_states(self) -> list[WorkerState] | None:
        """``/info``'s ``workers``: one entry per engine worker of a server that fronts several
        (a dead one reported as ``dead``, never dropped); the default reports none."""
        return None

    @property
    def default_mode(self) -> ReceiveMode:
        return "staged" if "staged" in self.capabilities.receive_modes else "direct"

    @abstractmethod
    def group_state(self) -> GroupState | None: ...

    @abstractmethod
    async def init_process_group(self, req: InitProcessGroupRequest) -> InitProcessGroupResponse:
        """Join (or re-join, replacing the old group) the weight-update group; returns once
        joined. Raises GroupError on failure."""

    def validate_update(self, req: WeightUpdateRequest) -> None:
        """Refuse, before any receive, an update that cannot apply: raises UpdateRejected with
        the HTTP status and the offending field. The default checks group, version, mode and the
        params against :meth:`param_specs`; backends may extend it."""
        validate_update_request(
            req,
            expected=self.param_specs(),
            current_version=self.version,
            modes=self.capabilities.receive_modes,
            group=self.group_state(),
        )

    @abstractmethod
    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport: ...

    def generation_hold(self) -> GenerationHoldLike | None:
        """A client's hold on generation (vLLM's ``/pause?mode=keep`` ... ``/resume``), for a
        backend that declares ``pause_generation``; the same object every call. Updates made
        while it holds run inside it. The default has none (the routes answer 501)."""
        return None

    def cancel_waiting_update(self, reason: str) -> bool:
        """Called when ``/init_process_group`` arrives while an update holds the control slot: if
        that update still waits for its (old) trainer's decision, make it end at once with
        UpdateAborted naming ``reason`` and return True. The default cannot (False): the new
        group is then refused with 409 until the update ends."""
        return False

    async def apply_floor(self, repeats: int) -> ApplyFloorResponse:
        """Benchmarks only (``POST /bench/apply_floor``): apply the weights now served to the
        engine itself ``repeats`` times through the same code an update's apply runs, with no
        transfer, and return each apply's seconds (timed where the apply runs). Must leave the
        served weights bit-identical and hold generation as an update's apply does. Called with
        the control slot held. The default cannot (NotImplementedError: answered 501); raise
        UpdateRejected (422) when there is nothing to re-apply yet."""
        raise NotImplementedError(f"the {self.name} backend does not time its apply")

    @abstractmethod
    async def probe_broadcast(self, req: ProbeBroadcastRequest) -> float:
        """Receive one flat broadcast of ``req.nbytes`` (after the trainer's ``go`` for
        ``probe/{probe_id}``) and discard it; returns the receive seconds."""

    @abstractmethod
    async def chat_completion(self, req: ChatCompletionRequest) -> ChatCompletionResponse: ...

    async def chat_completion_stream(self, req: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """A ``stream=true`` chat, for a backend that declares ``streaming``: check and plan the
        request here (raise InvalidRequest before anything is sent), then return the chunks.
        Closing the iterator (the client left) must abort the work in the engine. The default
        refuses (400 naming ``stream``)."""
        raise InvalidRequest(f"stream: the {self.name} backend does not stream; send stream=false", field="stream")

    async def completion(self, req: CompletionRequest) -> CompletionResponse:
        """``/v1/completions``, for a backend that declares ``completions``; the default refuses."""
        raise InvalidRequest(f"the {self.name} backend does not serve /v1/completions", field="prompt")

    async def completion_stream(self, req: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """A ``stream=true`` completion, for a backend that declares ``streaming`` and
        ``completions`` (as :meth:`chat_completion_stream`); the default refuses."""
        raise InvalidRequest(f"stream: the {self.name} backend does not stream; send stream=false", field="stream")

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """``/tokenize`` (vLLM's shape): the ids the generation routes would use for the prompt.
        The default refuses (400 naming ``tokenize``); the kit's backends answer."""
        raise InvalidRequest(f"tokenize: the {self.name} backend does not serve /tokenize", field="tokenize")

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """``/detokenize`` (vLLM's shape): the text of the ids. The default refuses."""
        raise InvalidRequest(f"detokenize: the {self.name} backend does not serve /detokenize", field="detokenize")


@runtime_checkable
class ServesItself(Protocol):
    """An inference backend whose engine owns its HTTP server (vLLM) defines ``serve``: serve
    the contract (the SDK's router and error handlers on the engine's app; see
    :func:`pipelinerl_sdk.kit.inference.serve.install_contract`) until SIGTERM/SIGINT, writing
    ``config.ready_file`` once it answers. Any other backend is served by the SDK's own server.
    How a backend is served is the launcher's business
    (:func:`pipelinerl_sdk.kit.inference.serve.serve`), not this contract's."""

    def serve(self, config: ServeConfig) -> None: ...


def check_group_id(wanted: str, group: GroupState | None) -> None:
    """UpdateRejected (409, field ``group_id``) unless ``wanted`` is the current group's id: a
    request formed for an earlier group (a replaced trainer's) must not take the update slot."""
    if group is None:
        raise UpdateRejected("no weight-update group: call /init_process_group first", status=409, field="group")
    if group.group_id is None or wanted != group.group_id:
        raise UpdateRejected(
            f"group_id {wanted!r} is not this server's current group ({group.group_id!r}): the group was "
            "formed again since; call /init_process_group again",
            status=409,
            field="group_id",
        )


def validate_update_request(
    req: WeightUpdateRequest,
    *,
    expected: Sequence[ParamSpec],
    current_version: int,
    modes: frozenset[ReceiveMode],
    group: GroupState | None,
) -> None:
    """The checks every server runs before it receives anything (see ``validate_update``)."""
    from pipelinerl_sdk.weights.buckets import BucketPlan  # pure python, no torch

    if group is None:
        raise UpdateRejected("no weight-update group: call /init_process_group first", status=409, field="group")
    if group.broken:
        raise UpdateRejected(
            f"weight-update group is broken ({group.reason}); call /init_process_group again",
            status=409,
            field="group",
        )
    check_group_id(req.group_id, group)
    if req.version <= current_version:
        raise UpdateRejected(
            f"version must increase: got {req.version}, serving {current_version}",
            status=409,
            field="version",
        )
    if req.mode is not None and req.mode not in modes:
        raise UpdateRejected(
            f"mode {req.mode!r} not supported (supported: {sorted(modes)})",
            status=422,
            field="mode",
        )
    by_name: Mapping[str, ParamSpec] = {p.name: p for p in expected}
    for i, p in enumerate(req.params):
        want = by_name.get(p.name)
        if want is None:
            raise UpdateRejected(f"unknown param {p.name!r}", status=422, field=f"params[{i}].name")
        if p.shape != want.shape:
            raise UpdateRejected(
                f"param {p.name!r}: shape {list(p.shape)} != expected {list(want.shape)}",
                status=422,
                field=f"params[{i}].shape",
            )
        if p.dtype != want.dtype:
            raise UpdateRejected(
                f"param {p.name!r}: dtype {p.dtype} != expected {want.dtype}",
                status=422,
                field=f"params[{i}].dtype",
            )
    missing = set(by_name) - {p.name for p in req.params}
    if missing:
        raise UpdateRejected(
            f"update must carry every param; missing {len(missing)}, e.g. {sorted(missing)[:3]}",
            status=422,
            field="params",
        )
    digest = BucketPlan.build(req.params, req.bucket_bytes).digest()
    if digest != req.plan_digest:
        raise UpdateRejected(
            "plan_digest does not match the bucket plan this server computes (SDK versions differ?)",
            status=400,
            field="plan_digest",
        )


# --- trainer ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrainerSpec:
    """What ``TrainerBackend.init`` loads and builds. ``model`` is an HF-format directory."""

    model: str
    dtype: str = "float32"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: Max global grad norm; None disables clipping (never an implicit default).
    grad_clip: float | None = 1.0
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Sequences to score or train on. Each sequence is the full token list (prompt + completion);
    ``completion_start[i]`` is the index of its first completion token. Per-token fields
    (``behaviour_logprobs``, ``ref_logprobs``) cover the completion tokens only."""

    input_ids: Sequence[Sequence[int]]
    completion_start: Sequence[int]
    advantages: Sequence[float] = ()
    behaviour_logprobs: Sequence[Sequence[float]] = ()
    ref_logprobs: Sequence[Sequence[float]] = ()

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.completion_start) != n:
            raise ValueError(f"completion_start: {len(self.completion_start)} entries for {n} sequences")
        for name in ("advantages", "behaviour_logprobs", "ref_logprobs"):
            v = getattr(self, name)
            if v and len(v) != n:
                raise ValueError(f"{name}: {len(v)} entries for {n} sequences")
        for i, (ids, start) in enumerate(zip(self.input_ids, self.completion_start, strict=True)):
            if not 1 <= start <= len(ids):
                raise ValueError(f"completion_start[{i}]={start} outside 1..{len(ids)}")

    def __len__(self) -> int:
        return len(self.input_ids)


class Objective(Protocol):
    """An RL objective: maps the new per-token logprobs of a micro-batch to a loss.

    ``logprobs[i]`` has one entry per token of sequence i after the first (see
    ``TrainerBackend.forward``). The returned loss is *summed* over micro-batches and ranks:
    trainers make the accumulated gradient equal the gradient of that sum."""

    def __call__(
        self, logprobs: Sequence[torch.Tensor], batch: TokenBatch
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


@runtime_checkable
class WeightSink(Protocol):
    """Where ``gather_and_broadcast`` puts full tensors, on trainer rank 0 only: one call per
    param, in ``param_specs()`` order. The sink copies what it keeps before returning.

    A sink may also offer ``slot(name) -> torch.Tensor`` (the SDK's
    :class:`~pipelinerl_sdk.weights.send.WeightSender` does): a writable tensor of the next param's
    dtype and shape lying where the sink reads it from. A trainer that makes each full tensor
    itself (a gather's copy-out) writes it there and then hands that same tensor to ``send``,
    which copies nothing. See :func:`slot_of`."""

    def send(self, name: str, tensor: torch.Tensor) -> None: ...


#: Where a trainer writes the full tensor of param ``name`` (the next one it hands over), or None
#: (anywhere: the sink copies it). :func:`slot_of` makes one from a sink.
Into = Callable[[str], "torch.Tensor | None"]


def slot_of(sink: WeightSink | None) -> Into | None:
    """The sink's ``slot`` (see :class:`WeightSink`), or None for a sink without one."""
    slot = getattr(sink, "slot", None)
    return slot if callable(slot) else None


def lend(sink: WeightSink, name: str, tensor: torch.Tensor) -> None:
    """Hand ``tensor`` to ``sink`` promising that it stays alive and unchanged until the update
    ends (the publisher's ``update`` block exits). A sink with a ``lend`` method (the SDK's
    :class:`~pipelinerl_sdk.weights.send.WeightSender`) may then broadcast straight from the
    tensor's memory; any other sink gets :meth:`WeightSink.send`. For trainers whose full params
    persist between steps (replicated weights, no gather); gathered layers are sent."""
    lender = getattr(sink, "lend", None)
    if callable(lender):
        lender(name, tensor)
    else:
        sink.send(name, tensor)


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int
    grad_norm: float
    lr: float


class TrainerBackend(ABC):
    """One rank of a trainer. SPMD: every rank calls the same methods in the same order.

    The process group is the launcher's: ``torchrun`` (plus
    :func:`pipelinerl_sdk.trainer_group.init_from_env`) or
    :func:`~pipelinerl_sdk.trainer_group.run_ranks` initialises the default ``torch.distributed``
    group before ``init``, and destroys it after ``close``. A backend never creates a group of
    several ranks itself; with no group at all it runs as world size 1 (it may create a private
    1-rank group, which its ``close`` destroys).

    ``init`` loads HF-format weights (identical on every rank), shards them as the backend does,
    and builds the optimizer. ``forward`` and ``backward`` see each rank's own micro-batch; a rank
    may get an empty one and must still take part in the collectives of the others.
    ``backward`` accumulates; only ``step`` changes weights (and zeroes gradients).

    The loss is *summed* over micro-batches and ranks (see :class:`Objective`): the step uses the
    gradient of that sum. Data-parallel engines (torch DDP, DeepSpeed, FSDP's default) *average*
    gradients over ranks; an adapter on one must undo the average (scale the loss by the world
    size, or set the engine's divide factor to 1). :mod:`pipelinerl_sdk.kit.trainer` implements
    this contract around a few engine hooks."""

    capabilities: TrainerCapabilities = TrainerCapabilities()

    @abstractmethod
    def init(self, spec: TrainerSpec) -> None: ...

    @abstractmethod
    def param_specs(self) -> list[ParamSpec]:
        """The full (unsharded) params under HF names, in the order ``gather_and_broadcast``
        yields them. The same on every rank."""

    @abstractmethod
    def forward(self, batch: TokenBatch) -> list[torch.Tensor]:
        """Per sequence, the logprob of every token after the first given its prefix
        (``len(ids) - 1`` values, float32, no grad)."""

    @abstractmethod
    def backward(self, batch: TokenBatch, objective: Objective) -> dict[str, float]:
        """Accumulate gradients of ``objective`` on this micro-batch; returns its metrics."""

    @abstractmethod
    def step(self) -> StepMetrics:
        """Reduce gradients across ranks, clip (if configured), step, zero gradients."""

    @abstractmethod
    def gather_and_broadcast(self, sink: WeightSink | None) -> None:
        """Gather full tensors one layer at a time (peak extra memory: one layer) and hand each
        to ``sink`` on rank 0; the other ranks pass None and take part in the gathers only."""

    @abstractmethod
    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Full parameters under HF names (those of ``param_specs()``), copied to CPU, on every
        rank: a collective, every rank calls it. For checkpoints (the pipeline saves an HF model
        from it) and tests."""

    @abstractmethod
    def close(self) -> None:
        """Release the model and optimizer (and a private group ``init`` created); the
        launcher's group stays."""


InferenceFactory = Callable[..., InferenceBackend]
TrainerFactory = Callable[..., TrainerBackend]
