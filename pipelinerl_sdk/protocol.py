"""Wire types of the inference contract (HTTP bodies), shared by servers and clients.

Every control-route body is a pydantic model with ``extra="forbid"``: an unknown field is an
error naming it, never silently dropped. The generation request ignores unknown fields, as vLLM
does (clients built against vLLM send its extensions). This module imports no torch: dtypes travel as names.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Element size in bytes of every dtype the weight-sync protocol carries.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
DTypeName = Literal["float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"]
GroupBackend = Literal["gloo", "nccl"]
ReceiveMode = Literal["direct", "staged"]


# --- store keys of the trainer's decisions (the one place their format is written) ------------


def update_key(version: int) -> str:
    """The group-store key of the trainer's decision (``go``/``abort``) on the update to ``version``."""
    return f"update/{version}"


def sending_key(version: int) -> str:
    """The group-store key of the trainer's mark that the update to ``version`` has its first
    param in hand (``go``; bytes flow next) or failed before sending any (``abort``). A receiver
    whose engine receives in place (SGLang) holds generation only once it is set."""
    return f"update/{version}/sending"


def probe_key(probe_id: int) -> str:
    """The group-store key of the trainer's decision on the probe broadcast ``probe_id``."""
    return f"probe/{probe_id}"


#: Largest weight version (and probe id) a request may carry: the largest integer every JSON
#: reader keeps exactly (2^53 - 1).
MAX_VERSION = (1 << 53) - 1
#: A group id (``weights.auth.group_id``): what ties an update to the group it was formed for.
GroupId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")]

# ASCII only (``\d`` would take any Unicode digit) and matched whole (``$`` allows a trailing "\n").
_INIT_METHOD = re.compile(r"tcp://(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(?P<port>[0-9]{1,5})")


class WireModel(BaseModel):
    """Base of every body: unknown fields are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ParamSpec(WireModel):
    """One tensor of the model, under its Hugging Face name."""

    name: Annotated[str, Field(min_length=1, max_length=512)]
    dtype: DTypeName
    shape: tuple[Annotated[int, Field(ge=0)], ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


def parse_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ValueError naming the field otherwise."""
    m = _INIT_METHOD.fullmatch(init_method)
    if m is None:
        raise ValueError(f"init_method must look like tcp://HOST:PORT, got {init_method!r}")
    port = int(m.group("port"))
    if not 0 < port < 65536:
        raise ValueError(f"init_method port out of range: {port}")
    return m.group("host").strip("[]"), port


class InitProcessGroupRequest(WireModel):
    """Join the weight-update group. The trainer is rank 0 and hosts the TCPStore at
    ``init_method``; this server's workers take ranks ``rank_offset .. rank_offset+workers-1``.
    ``group_secret`` is the trainer's random secret for this group (``weights.auth``): it signs
    the trainer's decisions in the store; it travels only in this control-token-guarded body."""

    init_method: str
    rank_offset: Annotated[int, Field(ge=1)]
    world_size: Annotated[int, Field(ge=2, le=65536)]
    backend: GroupBackend = "gloo"
    group_name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")] = (
        "pipelinerl-weights"
    )
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    group_secret: Annotated[str, Field(min_length=32, max_length=128, pattern=r"^[0-9a-f]+$", repr=False)]
    #: Every rendezvous value in the store is signed with the secret (``weights.signed_store``);
    #: a trainer asks it only of servers whose ``/info`` says ``signed_rendezvous``.
    signed_rendezvous: bool = False

    @field_validator("init_method")
    @classmethod
    def _check_init_method(cls, v: str) -> str:
        parse_init_method(v)
        return v


class InitProcessGroupResponse(WireModel):
    group_name: str
    #: The id every update for this group must carry (``weights.auth.group_id`` of the secret).
    group_id: str
    ranks: list[int]
    world_size: int
    backend: GroupBackend


class WeightUpdateRequest(WireModel):
    """Receive one broadcast of all ``params`` (in this order, bucketed by ``bucket_bytes``) and
    serve them as ``version``. ``plan_digest`` is the sender's digest of the bucket plan; the
    server recomputes the plan and refuses a mismatch before any receive starts. ``group_id`` is
    the id ``/init_process_group`` answered: an update for another group is refused (409)."""

    version: Annotated[int, Field(ge=1, le=MAX_VERSION)]
    group_id: GroupId
    params: Annotated[list[ParamSpec], Field(min_length=1)]
    bucket_bytes: Annotated[int, Field(ge=1024, le=1 << 34)]
    plan_digest: Annotated[str, Field(min_length=16, max_length=128)]
    mode: ReceiveMode | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0

    @model_validator(mode="after")
    def _unique_names(self) -> WeightUpdateRequest:
        seen: set[str] = set()
        for p in self.params:
            if p.name in seen:
                raise ValueError(f"params: duplicate name {p.name!r}")
            seen.add(p.name)
        return self


class UpdateEvent(WireModel):
    """One NDJSON line of the ``/request_weight_update`` response stream.

    ``accepted`` comes first, as soon as validation passed and the receive is armed; then exactly
    one of ``done`` (the new weights are live) or ``error`` (old weights still serving).

    ``timings``: durations in seconds (keys ending ``_s``: ``pause_s``, ``receive_s``, ``apply_s``,
    ``total_s``) and, where the server records them, the update's phases as wall-clock stamps
    (keys starting ``at_``: ``time.time()`` seconds on the server's clock; see
    :data:`SERVER_PHASES`). A client ignores keys it does not know."""

    event: Literal["accepted", "done", "error"]
    version: int
    mode: ReceiveMode | None = None
    detail: str | None = None
    timings: dict[str, float] = Field(default_factory=dict)


#: The phases of one update a server stamps in its ``done`` event's ``timings`` (``at_`` + name,
#: ``time.time()``), in the order a ``staged`` update goes through them (a ``direct`` one holds
#: generation, ``pause_request`` and ``pause_start``, before its ``last_bucket``); a server stamps
#: those it can observe, and an engine whose workers receive adds ``worker_*`` stamps of its own.
#: ``first_bucket``/``last_bucket``: the first and the last bucket of the broadcast received (the
#: closest a bucketed collective lets a receiver see its first and last byte).
SERVER_PHASES: tuple[str, ...] = (
    "request",  # the route was entered (body parsed)
    "validated",  # validation passed
    "armed",  # the receive is armed (the backend's ``on_accepted``)
    "accepted",  # the ``accepted`` line is handed to the response stream
    "decision",  # the server saw the trainer's ``go``
    "first_bucket",
    "last_bucket",
    "pause_request",  # the hold asked of the engine
    "pause_start",  # generation held from here (the engine said so) ...
    "apply_start",
    "apply_end",
    "pause_end",  # ... to here (the hold released)
    "done",  # the ``done`` line is handed to the response stream
)


class ApplyFloorRequest(WireModel):
    """``POST /bench/apply_floor`` (control, benchmarks only): apply the weights the server
    serves to itself ``repeats`` times through the engine's own apply of an update (no
    transfer) and time each apply. Nothing served changes; refused (409) while another control
    operation runs, and (422) by a server that has not applied an update it can re-apply."""

    repeats: Annotated[int, Field(ge=1, le=100)] = 3


class ApplyFloorResponse(WireModel):
    """The seconds of each apply (the slowest worker's, for an engine of several), and what was
    timed (``detail``: the engine's apply path)."""

    seconds: Annotated[list[float], Field(min_length=1)]
    detail: str


class ProbeBroadcastRequest(WireModel):
    """Receive one flat broadcast of ``nbytes`` and discard it: a link check and the
    benchmark's baseline. Guarded like the other control routes."""

    nbytes: Annotated[int, Field(ge=1, le=1 << 34)]
    probe_id: Annotated[int, Field(ge=0, le=MAX_VERSION)]
    group_id: GroupId
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0


class GroupState(WireModel):
    group_name: str
    #: The id updates for this group carry (None: a backend that predates group ids).
    group_id: str | None = None
    ranks: list[int]
    world_size: int
    backend: GroupBackend
    broken: bool
    reason: str | None = None


class WorkerState(WireModel):
    """One engine worker of a server that runs several (``ServerInfo.workers``): its weight
    version and state (``serving``, ``paused`` or ``dead``; ``reason`` says why it is dead);
    ``url``: the worker's own control endpoint, where the engine has one (loopback)."""

    index: int
    version: int | None
    state: Literal["serving", "paused", "dead"]
    pid: int | None = None
    url: str | None = None
    reason: str | None = None


class ServerInfo(WireModel):
    """``GET /info``: what a trainer checks before it broadcasts."""

    backend: str
    model: str
    version: int
    receiving_workers: int
    receive_modes: list[ReceiveMode]
    default_mode: ReceiveMode
    group: GroupState | None
    updating: bool
    params: list[ParamSpec]
    #: Prompt plus ``max_tokens`` may not exceed this (``None``: no limit declared).
    max_model_len: int | None = None
    #: The backend's declared capabilities (``InferenceCapabilities`` fields; sets as sorted lists).
    capabilities: dict[str, Any] = Field(default_factory=dict)
    #: Chat requests, and their completion tokens (``n`` x budget), admitted now (the admission
    #: limits bound both: past them, 429).
    requests_in_flight: int = 0
    tokens_in_flight: int = 0
    #: The server's engine workers, for a server that fronts several (``None``: not reported).
    workers: list[WorkerState] | None = None
    #: The server's workers join through the SDK's group, which can sign every rendezvous value
    #: (``InitProcessGroupRequest.signed_rendezvous``); False for an engine that forms it itself.
    signed_rendezvous: bool = False


# --- chat completions (OpenAI schema plus the extensions the contract adds) ----------------------


class TextPart(BaseModel):
    """One part of a message's content; text only (an image part is a 400 naming it)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message: content as a string or a list of text parts (joined with newlines, as vLLM
    does for string templates); ``name``, ``tool_calls`` and ``tool_call_id`` go to the chat
    template as given. Unknown fields are ignored (as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it (content a string)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        out = self.model_dump(exclude_none=True, exclude={"content"})
        out["content"] = content if content is not None else ""
        return out


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``{"name", "schema", "strict", "description"}``
    (the schema read as ``json_schema_body``: ``schema`` is a pydantic name)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema_body: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text``; ``json_object`` (any JSON object); ``json_schema`` (JSON
    matching ``json_schema.schema``)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` extension: at most one of ``json`` (a schema, object or
    JSON text), ``json_object``, ``regex``, ``grammar`` (EBNF), ``choice``; ``disable_any_whitespace``
    drops JSON's optional whitespace. ``whitespace_pattern``, ``structural_tag`` and
    ``disable_additional_properties`` are refused (400 naming them)."""

    model_config = ConfigDict(extra="ignore")

    #: ``json`` on the wire.
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputsParams:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        kinds = [k for k, v in given.items() if v is not None] + (["json_object"] if self.json_object else [])
        if len(kinds) > 1:
            raise ValueError(f"only one kind of structured output may be set, got {kinds}")
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not served")
        if self.disable_additional_properties:
            raise ValueError("disable_additional_properties is not served")
        return self


#: The OpenAI/vLLM range of the presence and frequency penalties.
Penalty = Annotated[float, Field(ge=-2, le=2)]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields chat and completions requests share, as vLLM 0.32 takes them: the sampling
    settings, the stop rule, the extensions. Unknown fields are ignored (as vLLM does); a known
    field a backend cannot honour is a 400 naming it.

    vLLM's extensions: ``return_token_ids``, ``ignore_eos``, ``min_tokens`` (capability
    ``min_tokens``: no end before that many tokens, as vLLM: see :attr:`min_tokens`), ``top_k``
    (``None``, 0 or -1: off), ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``include_stop_str_in_output``,
    ``skip_special_tokens``, ``return_tokens_as_token_ids`` (every logprob ``token`` is
    ``token_id:N``) and ``prompt_logprobs`` (``N``: each prompt token's logprob given its prefix
    with the ``N`` best alternatives; ``true`` counts as 0).

    **Which logprobs** (``logprobs``, ``top_logprobs``, ``prompt_logprobs``): always the raw
    model's, ``log_softmax`` of the logits in float32, *before* temperature, penalties,
    ``logit_bias``, top-k/top-p/min-p or any other sampling transform; tokens are still
    *sampled* with them applied. The trainer computes exactly these for its importance ratios,
    so an engine that reports processed logprobs breaks RL, not just a check (vLLM:
    ``logprobs_mode="raw_logprobs"``; SGLang: ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    seed: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    #: Extension (as in vLLM): generate exactly the token budget, ignoring end-of-sequence.
    ignore_eos: bool = False
    #: Extension (as in vLLM): the first ``min_tokens`` tokens are never a stop token or an
    #: end-of-sequence (those ids are masked, ``ignore_eos`` or not), and a stop string counts only
    #: where it ends past their text. At most the token budget; a backend that does not declare
    #: capability ``min_tokens`` answers a non-zero value with a 400 naming it.
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty strings dropped)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stop if s)

    @property
    def prompt_top(self) -> int | None:
        """How many alternatives each prompt logprob carries (None: no prompt logprobs)."""
        if self.prompt_logprobs is None or self.prompt_logprobs is False:
            return None
        return 0 if self.prompt_logprobs is True else int(self.prompt_logprobs)


class ChatCompletionRequest(SamplingRequest):
    """OpenAI chat-completion request as vLLM 0.32 takes it (:class:`SamplingRequest`'s fields
    and these). Without ``max_tokens`` a request generates to the end of the context. vLLM's
    chat extension: ``chat_template_kwargs``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    #: vLLM's extension (:class:`StructuredOutputsParams`); a structured ``response_format``
    #: overrides its constraint, a forced ``tool_choice`` both.
    structured_outputs: StructuredOutputsParams | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    #: False: ``tool_choice="required"`` makes exactly one call (vLLM's ``maxItems`` 1).
    parallel_tool_calls: bool | None = True

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


#: A completions prompt: text, token ids, or a batch of either.
Prompt = (
    str
    | Annotated[list[int], Field(min_length=1)]
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingRequest):
    """OpenAI completions request as vLLM 0.32 takes it (:class:`SamplingRequest`'s fields and
    these): ``prompt`` text (tokenized with the model's special tokens, as vLLM), token ids
    (token-in, token-out: nothing re-tokenised), or a batch of either (choice ``p * n + i`` is
    sample ``i`` of prompt ``p``). ``max_tokens`` defaults to 16, as in vLLM; ``logprobs`` N
    reports each token's logprob and its N best alternatives."""

    prompt: Prompt
    #: 0 only with ``echo`` (vLLM's way to score a prompt: its logprobs, nothing generated shown).
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    #: The prompt in front of each choice's text (and, with ``logprobs``, of its logprobs).
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one unless a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)  # type: ignore[arg-type]


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a ``prompt``, as vLLM 0.32 takes it: the text's ids, with the
    model's special tokens unless ``add_special_tokens`` is false. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with ``messages``, as vLLM 0.32 takes it: the ids the chat route would
    generate from (the chat template with ``tools`` and ``chat_template_kwargs``; special tokens
    added on top only with ``add_special_tokens``). Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be set with add_generation_prompt (as vLLM)")
        return self


class TokenizeResponse(WireModel):
    """``/tokenize``'s answer (vLLM's shape): the ids, their count, the server's context, and
    each id's token string when asked."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): ids of the model's vocabulary."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(WireModel):
    """``/detokenize``'s answer: the ids' text, special tokens included (vLLM's decode)."""

    prompt: str


class TopLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(WireModel):
    """One completion token: ``logprob`` is the raw model's (``log_softmax`` of the logits before
    temperature and top-p, see :class:`ChatCompletionRequest`); ``top_logprobs`` the best
    alternatives by that same measure, best first."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(WireModel):
    content: list[TokenLogprob]


class AssistantMessage(WireModel):
    """``tool_calls``: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``
    (``arguments`` JSON text), parsed from the text or forced by ``tool_choice``; ``content`` is
    then the text before the calls (``""`` when there is none)."""

    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(WireModel):
    index: int
    message: AssistantMessage
    #: ``tool_calls``: tools were called (``tool_choice`` ``auto`` with a parser, or
    #: ``required``); a named tool choice ends with ``stop``, as in vLLM.
    finish_reason: Literal["stop", "length", "abort", "tool_calls"]
    #: As in vLLM: the stop string or stop token id that ended the choice (None: end of sequence
    #: or length).
    stop_reason: str | int | None = None
    logprobs: ChoiceLogprobs | None = None
    #: Extension: completion token ids (with ``return_token_ids``).
    token_ids: list[int] | None = None
    #: Extension: the weight version that produced each completion token (always present).
    weight_versions: list[int]


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(WireModel):
    """One token of a prompt-logprob entry (vLLM's ``Logprob``): ``rank`` 1 is the most likely
    (None: the engine does not report it)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatCompletionResponse(WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    #: Extension: with ``return_token_ids``.
    prompt_token_ids: list[int] | None = None
    #: Extension (vLLM's shape): with ``prompt_logprobs``, one entry per prompt token, the first
    #: None: ``{token id: {logprob, rank, decoded_token}}`` for the prompt token and its best
    #: alternatives; raw logprobs (before temperature, like every logprob here).
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None

    def prompt_token_logprobs(self) -> list[float | None]:
        """Each prompt token's own logprob from :attr:`prompt_logprobs` (first None): the
        entry's token named by ``prompt_token_ids``, else its only token (``prompt_logprobs``
        0 or true). ValueError without prompt logprobs or when an entry is ambiguous."""
        if self.prompt_logprobs is None:
            raise ValueError("the response has no prompt_logprobs (ask with prompt_logprobs)")
        ids = self.prompt_token_ids
        out: list[float | None] = []
        for i, entry in enumerate(self.prompt_logprobs):
            if entry is None:
                out.append(None)
            elif ids is not None:
                out.append(entry[ids[i]].logprob)
            elif len(entry) == 1:
                out.append(next(iter(entry.values())).logprob)
            else:
                raise ValueError("prompt_logprobs entries with alternatives need prompt_token_ids (return_token_ids)")
        return out


class ChunkDelta(WireModel):
    """What a stream chunk adds to a choice: the role (first chunk only), text, and tool-call
    parts as OpenAI streams them: ``{"index", "id", "type", "function": {"name", "arguments"}}``
    on a call's first part, ``{"index", "function": {"arguments"}}`` on the later ones (a
    client joins the ``arguments`` of one ``index``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamChunk(WireModel):
    """What every server-sent event of a stream carries (chat and completions): the stream's
    ``id``, ``created`` and ``model``, and ``usage`` on the last one if asked."""

    id: str
    created: int
    model: str
    usage: Usage | None = None


class StreamedChoice(WireModel):
    """What every streamed choice's part carries (chat and completions): ``index``, for the
    tokens of this chunk their ids (with ``return_token_ids``) and weight versions (one per
    token, always), and on the choice's last content chunk ``finish_reason``/``stop_reason``."""

    index: int
    #: ``tool_calls``: chat only (as :class:`ChatChoice`'s).
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    weight_versions: list[int] = Field(default_factory=list)


class ChunkChoice(StreamedChoice):
    """One choice's part of a stream chunk: the text released (``delta``) and its tokens'
    logprobs (if asked), besides :class:`StreamedChoice`'s."""

    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(StreamChunk):
    """One server-sent event of a streamed chat (vLLM 0.32's ``chat.completion.chunk``): first a
    chunk with each choice's role (and ``prompt_token_ids`` with ``return_token_ids``), then
    content chunks, then with ``stream_options.include_usage`` one with ``usage`` and no choices;
    the stream ends with ``data: [DONE]``."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(WireModel):
    """OpenAI's completions ``logprobs``: per token its text (``token_id:N`` with
    ``return_tokens_as_token_ids``), raw logprob, best alternatives (text -> logprob) and
    character offset in the text."""

    tokens: list[str]
    #: None for the first token of an echoed prompt (nothing comes before it), as vLLM.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(WireModel):
    """One completion; vLLM's extensions ``token_ids``, ``prompt_token_ids`` (with
    ``return_token_ids``), ``prompt_logprobs``; ours: ``weight_versions``, one per token."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    weight_versions: list[int]


class CompletionResponse(WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(StreamedChoice):
    """One choice's part of a streamed completion: the text released, its tokens' logprobs
    (OpenAI's completions shape), ``prompt_token_ids`` on its first chunk (with
    ``return_token_ids``), besides :class:`StreamedChoice`'s."""

    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(StreamChunk):
    """One server-sent event of a streamed ``/v1/completions`` (vLLM's shape); with
    ``stream_options.include_usage`` the last has ``usage`` and no choices; then ``data: [DONE]``."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]


class ErrorBody(WireModel):
    """Every 4xx/5xx body of the contract, OpenAI's shape: ``{"error": {"message", "type",
    "param", "code"}}`` (``code``: the HTTP status, as vLLM sends)."""

    error: dict[str, Any]
