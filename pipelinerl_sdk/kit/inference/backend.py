"""The engine-independent part of an inference backend: identity (from its
:class:`~pipelinerl_sdk.kit.inference.card.EngineCard`), options, version and group bookkeeping,
the update template. An adapter subclasses :class:`KitBackend` and writes only what is specific
to its engine."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from pipelinerl_sdk.contracts import InferenceBackend, ServeConfig, UpdateReport
from pipelinerl_sdk.errors import GroupError, InvalidRequest, PluginError
from pipelinerl_sdk.kit.inference.book import GroupBook
from pipelinerl_sdk.kit.inference.card import EngineCard
from pipelinerl_sdk.kit.inference.chat import ChatPlan, plan_chat
from pipelinerl_sdk.kit.inference.completion import plan_completion
from pipelinerl_sdk.kit.inference.hold import GenerationHold
from pipelinerl_sdk.kit.inference.stream import TokenStep, chat_chunks, completion_chunks
from pipelinerl_sdk.kit.inference.tokenize import detokenize, tokenize
from pipelinerl_sdk.kit.inference.tools import TOOL_CALL_PARSERS
from pipelinerl_sdk.kit.inference.update import UpdateSteps, run_update
from pipelinerl_sdk.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChunk,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GroupState,
    InitProcessGroupRequest,
    ParamSpec,
    ReceiveMode,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    WeightUpdateRequest,
)

#: Options every kit backend takes, beside its card's.
KIT_OPTIONS = {
    "tool_call_parser": f"parse tool calls from tool_choice 'auto' text ({', '.join(TOOL_CALL_PARSERS)})",
}


class KitBackend(InferenceBackend):
    """An :class:`InferenceBackend` with everything but the engine done.

    Subclasses set :attr:`card` (the :class:`~pipelinerl_sdk.kit.inference.card.EngineCard` their
    plugin registers: name, ``capabilities``, ``--option`` names, the engine they need), fill
    :attr:`specs`, :attr:`workers` and :attr:`tokenizer` (in the constructor or ``start``; an
    engine that loads the model itself calls :meth:`read_model_files`), and implement
    ``start``/``stop``, ``init_process_group`` (join, then :meth:`GroupBook.join
    <pipelinerl_sdk.kit.inference.book.GroupBook.join>`), :meth:`update_steps`,
    ``probe_broadcast`` and ``chat_completion`` (with :mod:`pipelinerl_sdk.kit.inference.chat`).

    The constructor checks what every server refuses before loading anything: unknown options,
    a model directory without ``config.json``, a dtype or receive mode outside the capabilities
    (ValueError/FileNotFoundError naming it). :attr:`version` and :meth:`group_state` come from
    :attr:`book`; ``update_weights`` runs :meth:`update_steps` through
    :func:`~pipelinerl_sdk.kit.inference.update.run_update` (ordering, pause, abandon on failure,
    error normalisation, the report)."""

    card: ClassVar[EngineCard]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "card" in cls.__dict__:  # the class's capabilities are the registered ones
            cls.capabilities = cls.card.capabilities

    def __init__(self, config: ServeConfig) -> None:
        card = self.card
        if card.engine is not None and importlib.util.find_spec(card.engine[0]) is None:
            raise PluginError(f"the {card.name} backend needs {card.engine[1]}")
        known = {**KIT_OPTIONS, **card.options}
        unknown = set(config.options) - set(known)
        if unknown:
            raise ValueError(
                f"unknown option(s) for the {card.name} backend: {sorted(unknown)} (known: {sorted(known)})"
            )
        parser = config.options.get("tool_call_parser")
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"option tool_call_parser: {parser!r} is not one of {list(TOOL_CALL_PARSERS)}")
        if not Path(config.model, "config.json").is_file():
            raise FileNotFoundError(f"model: no HF model at {config.model!r} (config.json missing)")
        caps = self.capabilities
        if config.dtype not in caps.dtypes:
            raise ValueError(
                f"dtype {config.dtype!r} not served by the {card.name} backend (use {sorted(caps.dtypes)})"
            )
        if config.receive_mode is not None and config.receive_mode not in caps.receive_modes:
            raise ValueError(
                f"receive mode {config.receive_mode!r}: the {card.name} backend receives "
                f"{' or '.join(repr(m) for m in sorted(caps.receive_modes))} only"
            )
        self.config = config
        self.opts = dict(config.options)
        self.book = GroupBook()
        #: The params an update must carry (HF names, the served dtype), in the model's order.
        self.specs: list[ParamSpec] = []
        #: How many ranks this server contributes to the weight-update group.
        self.workers = 1
        #: The model's HF tokenizer (:meth:`read_model_files`, or the adapter's own).
        self.tokenizer: Any = None
        #: The model's vocabulary size (its config's ``vocab_size``: :meth:`read_model_files`, or
        #: the adapter's own); token-id prompts are checked against it (and the tokenizer's size).
        self.vocab_size: int | None = None
        self._client_hold: GenerationHold | None = None

    @property
    def tool_parser(self) -> str | None:
        """The server's tool-call parser (``--option tool_call_parser=NAME``), or None: with
        ``tools`` and ``tool_choice`` ``auto`` the text is then plain content."""
        return self.opts.get("tool_call_parser")

    def read_model_files(self) -> None:
        """Fill :attr:`tokenizer` (HF ``AutoTokenizer`` of the model directory), :attr:`specs`
        (its params under HF names in the served dtype) and :attr:`vocab_size` (its config's)
        without loading any weight: for an engine that loads the model itself."""
        from transformers import AutoConfig, AutoTokenizer

        from pipelinerl_sdk.weights.tensors import hf_param_specs

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.specs = hf_param_specs(self.config.model, self.config.dtype)
        hf = AutoConfig.from_pretrained(self.config.model)
        size = getattr(hf.get_text_config(), "vocab_size", None)
        self.vocab_size = int(size) if isinstance(size, int) else None

    def param_specs(self) -> list[ParamSpec]:
        return list(self.specs)

    @property
    def receiving_workers(self) -> int:
        return self.workers

    @property
    def name(self) -> str:
        return self.card.name

    @property
    def model_name(self) -> str:
        return str(self.config.model)

    @property
    def version(self) -> int:
        return self.book.version

    @property
    def default_mode(self) -> ReceiveMode:
        return self.config.receive_mode or super().default_mode

    def group_state(self) -> GroupState | None:
        return self.book.state()

    def require_group(self) -> InitProcessGroupRequest:
        """The joined group's init request; GroupError if none was joined."""
        if self.book.request is None:
            raise GroupError("no weight-update group: call /init_process_group first")
        return self.book.request

    def refuse_nccl_on_cpu(self, req: InitProcessGroupRequest, on_cpu: bool) -> None:
        """InvalidRequest naming ``backend`` for an NCCL group on a CPU server (before anything
        joins): the request asks what this server cannot do (400, not the group's 502)."""
        if req.backend == "nccl" and on_cpu:
            raise InvalidRequest(
                f"backend 'nccl' needs CUDA; this {self.card.name} server runs on CPU (use 'gloo')", field="backend"
            )

    async def update_weights(
        self, req: WeightUpdateRequest, mode: ReceiveMode, on_accepted: Callable[[], None]
    ) -> UpdateReport:
        steps = self.update_steps(req, mode)
        hold = self.generation_hold()
        if hold is not None:  # an update made while a client holds generation runs inside the hold
            steps = replace(steps, paused=hold.around(steps.paused))
        return await run_update(self.book, req, mode, on_accepted, steps)

    def engine_pause(self) -> Callable[[], AbstractAsyncContextManager[Any]] | None:
        """The engine's pause (the one its updates hold generation with), for a client's hold
        (:meth:`generation_hold`); a backend whose card declares ``pause_generation`` returns it.
        Default: None."""
        return None

    def generation_hold(self) -> GenerationHold | None:
        if self._client_hold is None:
            pause = self.engine_pause()
            if pause is not None:
                self._client_hold = GenerationHold(pause)
        return self._client_hold

    def update_steps(self, req: WeightUpdateRequest, mode: ReceiveMode) -> UpdateSteps:
        """The engine's steps of the update to ``req.version`` (validated already)."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_steps")

    # --- streaming ------------------------------------------------------------------------------

    async def chat_completion_stream(self, req: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Streamed chat from :meth:`sample_steps` (declare ``streaming`` in the card): the
        request planned (400s raised here, before anything is sent), then the kit's chunks
        (:func:`~pipelinerl_sdk.kit.inference.stream.chat_chunks`)."""
        if self.max_model_len is None:
            raise NotImplementedError(f"{type(self).__name__} must report max_model_len to stream")
        plan = await self.prepare(
            await plan_chat(self.tokenizer, req, self.max_model_len, structured=self.capabilities.structured_outputs)
        )
        samples = [self.sample_steps(plan, req, i) for i in range(req.n)]
        return chat_chunks(self.tokenizer, self.model_name, req, plan, samples, self.ending_ids(req), self.tool_parser)

    async def completion_stream(self, req: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """Streamed ``/v1/completions`` from :meth:`sample_steps` (capabilities ``streaming``
        and ``completions``): planned first (400s here), then the kit's chunks."""
        if self.max_model_len is None:
            raise NotImplementedError(f"{type(self).__name__} must report max_model_len to stream")
        plans = [
            await self.prepare(p)
            for p in await plan_completion(self.tokenizer, req, self.max_model_len, self.vocab_size)
        ]
        samples = [self.sample_steps(plan, req, i) for plan in plans for i in range(req.n)]
        return completion_chunks(self.tokenizer, self.model_name, req, plans, samples, self.ending_ids(req))

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """The ids this backend generates from for ``req``'s prompt, off the event loop."""
        context = self.max_model_len if self.max_model_len is not None else 0
        return await asyncio.to_thread(tokenize, self.tokenizer, req, context)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``req.tokens``, off the event loop."""
        return await asyncio.to_thread(detokenize, self.tokenizer, req, self.vocab_size)

    async def prepare(self, plan: ChatPlan) -> ChatPlan:
        """``plan`` with the engine's own work on it done, off the event loop, before any of its
        samples: e.g. its ``structured`` output compiled into ``constraint`` (a grammar can take
        seconds to compile; on the loop it would stall every request). InvalidRequest (a 400)
        for what the engine refuses. The default has nothing to do."""
        return plan

    def sample_steps(self, plan: ChatPlan, req: SamplingRequest, i: int) -> AsyncIterator[TokenStep]:
        """Sample ``i`` of ``req`` (for ``plan``'s prompt) as the engine produces it, ending
        with a step that carries the finish reason; closing the iterator must abort the sample
        in the engine."""
        raise NotImplementedError(f"{type(self).__name__} must implement sample_steps to stream")

    def ending_ids(self, req: SamplingRequest) -> frozenset[int]:
        """The token ids that end a sample of ``req``: ``stop_token_ids``, and the tokenizer's
        EOS unless ``ignore_eos`` (override where the engine stops on more)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ends = frozenset(req.stop_token_ids or ())
        return ends if req.ignore_eos or not isinstance(eos, int) else ends | {eos}
