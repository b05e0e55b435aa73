"""Chat preparation and response assembly, the same for every engine: the chat template and the
context check before generation; the OpenAI response with the contract's extensions (token ids,
raw logprobs, one weight version per completion token) after it."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import TemplateError

from pipelinerl_sdk.errors import InvalidRequest, PromptTooLong
from pipelinerl_sdk.kit.inference.structured import StructuredOutput, structured_output
from pipelinerl_sdk.kit.inference.tools import choice_tool_calls
from pipelinerl_sdk.logprobs import choice_logprobs
from pipelinerl_sdk.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    PromptLogprob,
    SamplingRequest,
    Usage,
)

FinishReason = Literal["stop", "length", "abort"]

#: Arguments of the template call a request's ``chat_template_kwargs`` may not override.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "return_dict", "return_tensors", "add_generation_prompt"}
)

#: The smallest positive temperature sampled as asked; a smaller one is raised to it, as vLLM does
#: (its ``_MAX_TEMP``): ``logits / 1e-40`` overflows float32 and leaves no distribution to sample.
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What to generate for one request: the templated prompt's ids, the token budget (fits the
    context; without one in the request, the rest of the context, as vLLM), how many top
    alternatives to report (0: none), the stop strings and stop token ids, and the sampling values
    the engine computes with (``temperature`` 0 or at least :data:`MIN_TEMPERATURE`; ``top_p`` as
    asked: an engine's top-p keeps at least the most likely token, however small it is), and
    what the text is constrained to (``structured``: a structured ``response_format``, vLLM's
    ``structured_outputs`` or a forced ``tool_choice``; None: free text), and ``constraint``: the
    engine's own form of ``structured`` (its compiled grammar, its request parameter), made off
    the event loop by the backend's ``prepare`` before any sample (None until then)."""

    prompt_ids: list[int]
    max_tokens: int
    top: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    structured: StructuredOutput | None = None
    constraint: Any = None


def sampling_temperature(temperature: float) -> float:
    """The temperature an engine samples with: 0 (greedy) or at least :data:`MIN_TEMPERATURE`."""
    return 0.0 if temperature == 0 else max(temperature, MIN_TEMPERATURE)


def check_text(req: ChatCompletionRequest) -> None:
    """InvalidRequest naming ``messages.I.content`` for text that is not valid Unicode (a lone
    surrogate, which JSON's ``\\ud800`` escape can carry): no tokenizer can encode it."""
    for i, m in enumerate(req.messages):
        try:
            str(m.for_template()["content"]).encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(
                f"messages.{i}.content: not valid Unicode at character {e.start} ({e.reason})",
                field=f"messages.{i}.content",
            ) from None


def refuse(req: SamplingRequest, unsupported: Mapping[str, str]) -> None:
    """InvalidRequest naming the first field of ``unsupported`` (name -> why) the request (chat
    or completions) sets to other than its default, and for what no backend serves yet: prompt
    logprobs in a stream (vLLM refuses them too). Whether a backend streams at all is the
    router's check (capability ``streaming``), whether it constrains text :func:`constrain`'s."""
    defaults = type(req).model_fields
    for name, why in unsupported.items():
        if name in req.model_fields_set and getattr(req, name) != defaults[name].default:
            raise InvalidRequest(f"{name}: {why}", field=name)
    if req.stream and req.prompt_top is not None:
        raise InvalidRequest("prompt_logprobs: not available with stream=true (as in vLLM)", field="prompt_logprobs")


def constrain(req: ChatCompletionRequest, served: bool) -> StructuredOutput | None:
    """What ``req``'s text is constrained to (:func:`~.structured.structured_output`, which
    checks it). InvalidRequest naming the field where the backend does not constrain text
    (``served`` False: a structured ``response_format``, ``tool_choice`` ``required`` or a named
    function)."""
    so = structured_output(req)
    if so is None:
        return None
    if not served:
        raise InvalidRequest(
            f"{so.field}: structured output ({so.kind}) is not served by this backend "
            "(served: response_format 'text', tool_choice 'none' and 'auto')",
            field=so.field,
        )
    return so


def render_prompt(tokenizer: Any, req: ChatCompletionRequest, max_model_len: int | None = None) -> list[int]:
    """The request's messages (and ``tools``) through the chat template, with its
    ``chat_template_kwargs``, tokenised as ``apply_chat_template(tokenize=True)`` does;
    InvalidRequest naming the field if the template refuses them. A prompt that leaves no room
    to generate in ``max_model_len`` is :class:`PromptTooLong`, found before its ids are made
    Python objects (:func:`encode_prompt`)."""
    return encode_prompt(tokenizer, render_text(tokenizer, req), max_model_len)


def render_text(tokenizer: Any, req: ChatCompletionRequest) -> str:
    """The request's messages (and ``tools``) through the chat template, with its
    ``chat_template_kwargs``, as text; InvalidRequest naming the field if the template refuses."""
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs: may not set {reserved}", field="chat_template_kwargs")
    if req.tools:
        kwargs["tools"] = req.tools
    try:
        text = tokenizer.apply_chat_template(
            [m.for_template() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except (TemplateError, TypeError, ValueError) as e:
        field = "chat_template_kwargs" if req.chat_template_kwargs else "messages"
        raise InvalidRequest(f"{field}: the chat template refused the request: {e}", field=field) from e
    return str(text)


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer when encoding with it
    directly gives what the transformers call gives (no truncation or padding configured on it,
    special tokens split alike); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if bool(backend.encode_special_tokens) != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


#: Characters of a rendered prompt tokenised at once when it is counted in pieces.
COUNT_CHUNK_CHARS = 1 << 18

#: Tokens one cut between pieces may add to their count, generously: cut at a space before a
#: word, a byte-level BPE with a GPT-2-style split counts the same, a SentencePiece one a prefix
#: marker more.
CUT_SLACK_TOKENS = 8


def encode_prompt(tokenizer: Any, text: str, max_model_len: int | None = None) -> list[int]:
    """The ids of a rendered prompt (no special tokens added, as ``apply_chat_template``).

    A fast tokenizer is called through ``encode_batch``, which releases the GIL while it
    tokenises (the event loop keeps serving), and a prompt that leaves no room in
    ``max_model_len`` (:func:`check_prompt_length`) is refused by its length before its ids
    become Python objects. A prompt of many pieces (:data:`COUNT_CHUNK_CHARS`) is first counted
    piece by piece (:func:`count_in_pieces`): one far past the context is refused as soon as
    its first pieces hold more tokens than the context, without ever holding all its tokens,
    whose freeing alone holds the GIL for hundreds of milliseconds."""
    backend = rust_tokenizer(tokenizer)
    if backend is None:
        ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        check_prompt_length(len(ids), max_model_len)
        return ids
    if max_model_len is not None and len(text) > COUNT_CHUNK_CHARS:
        counted, cuts = count_in_pieces(backend, text, enough=max_model_len)
        if counted - cuts * CUT_SLACK_TOKENS >= max_model_len:
            check_prompt_length(counted - cuts * CUT_SLACK_TOKENS, max_model_len, at_least=True)
    (encoding,) = backend.encode_batch([text], add_special_tokens=False)
    n = len(encoding)
    if max_model_len is not None and n >= max_model_len:
        del encoding  # freed here, on this thread: an exception's traceback would keep it alive
        check_prompt_length(n, max_model_len)
    return list(encoding.ids)


def count_in_pieces(backend: Any, text: str, enough: int | None = None) -> tuple[int, int]:
    """(tokens, cuts): the sum of the token counts of ``text``'s pieces of about
    :data:`COUNT_CHUNK_CHARS` characters, each cut at a space before a word where there is one,
    tokenised one at a time (the GIL released while each is), and the number of cuts; with
    ``enough``, the pieces up to the first whose sum, less :data:`CUT_SLACK_TOKENS` per cut,
    reaches it (the whole text has at least as many tokens)."""
    counted = cuts = start = 0
    while start < len(text) and (enough is None or counted - cuts * CUT_SLACK_TOKENS < enough):
        end = min(start + COUNT_CHUNK_CHARS, len(text))
        if end < len(text):
            space = text.rfind(" ", start + COUNT_CHUNK_CHARS // 2, end)
            while space > start and text[space - 1].isspace():
                space -= 1
            end = space if space > start else end
            cuts += 1
        (encoding,) = backend.encode_batch([text[start:end]], add_special_tokens=False)
        counted += len(encoding)
        del encoding
        start = end
    return counted, cuts


def check_prompt_length(n: int, max_model_len: int | None, *, at_least: bool = False) -> None:
    """PromptTooLong (field ``messages``) for a prompt of ``n`` tokens (``at_least`` ``n``) that
    leaves no room to generate in ``max_model_len`` (None: no check)."""
    if max_model_len is not None and max_model_len - n < 1:
        raise PromptTooLong(
            f"prompt ({'at least ' if at_least else ''}{n} tokens) leaves no room to generate in the context "
            f"({max_model_len})",
            field="messages",
        )


def prepare_chat(
    tokenizer: Any,
    req: ChatCompletionRequest,
    max_model_len: int,
    *,
    unsupported: Mapping[str, str] = {},
    structured: bool = False,
) -> ChatPlan:
    """Check the request (:func:`refuse` with the backend's ``unsupported`` fields,
    :func:`constrain` with whether it serves ``structured`` output), apply the chat template
    and check the context. Raises :class:`InvalidRequest` (``top_logprobs``
    without ``logprobs``, an unsupported field) or :class:`PromptTooLong` (prompt plus budget
    past ``max_model_len``), each naming the field, as it does for text that is not valid
    Unicode (:func:`check_text`); the router answers 400. Runs on the caller's thread: from a
    coroutine, use :func:`plan_chat`."""
    refuse(req, unsupported)
    so = constrain(req, structured)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", field="top_logprobs")
    check_text(req)
    prompt_ids = render_prompt(tokenizer, req, max_model_len)
    room = max_model_len - len(prompt_ids)
    max_tokens = req.token_budget or room
    if max_tokens > room:
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise PromptTooLong(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context ({max_model_len})",
            field=field,
        )
    return ChatPlan(
        prompt_ids,
        max_tokens,
        top,
        req.stop_strings,
        tuple(req.stop_token_ids or ()),
        sampling_temperature(req.temperature),
        req.top_p,
        so,
    )


def sampling_args(plan: ChatPlan, req: SamplingRequest, i: int) -> dict[str, Any]:
    """The sampling values of sample ``i`` of ``req`` under vLLM's names: ``temperature`` and
    ``top_p`` as the plan computes with, ``top_k`` (0: off), ``min_p``, the three penalties,
    ``min_tokens`` and ``seed`` (``seed + i``: the samples of one seeded request differ, and
    replay alike)."""
    return {
        "min_tokens": req.min_tokens,
        "temperature": plan.temperature,
        "top_p": plan.top_p,
        "top_k": req.top_k or 0,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": None if req.seed is None else req.seed + i,
    }


async def plan_chat(
    tokenizer: Any,
    req: ChatCompletionRequest,
    max_model_len: int,
    *,
    unsupported: Mapping[str, str] = {},
    structured: bool = False,
) -> ChatPlan:
    """:func:`prepare_chat` on a worker thread: the chat template and the tokenizer are CPU work
    that grows with the prompt, and on the event loop they would stall every other request
    (``/health`` included) for as long. After a prompt of :data:`TRIM_AFTER_CHARS` or more the
    C heap's free pages go back to the system (:func:`trim_heap`): the tokenizer's working memory
    for it is many times the prompt's size."""
    try:
        return await asyncio.to_thread(
            prepare_chat, tokenizer, req, max_model_len, unsupported=unsupported, structured=structured
        )
    finally:
        if sum(len(str(m.for_template()["content"])) for m in req.messages) >= TRIM_AFTER_CHARS:
            await asyncio.to_thread(trim_heap)


#: Prompts of this many characters or more are followed by :func:`trim_heap`.
TRIM_AFTER_CHARS = 1 << 20


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def trim_heap() -> bool:
    """Return the free pages of every malloc arena to the system (glibc's ``malloc_trim``; False
    where there is none). Freed memory otherwise stays in the process: a thread's arena keeps
    what a big tokenisation used. The GIL is released during the call (ctypes)."""
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


def version_label(label: str | None) -> int:
    """An engine's weight-version label as the contract's integer: a label that is not an
    integer (vLLM names its initial weights ``"default"``), or none, is version 0."""
    try:
        return int(label) if label is not None else 0
    except ValueError:
        return 0


def versions_from_spans(spans: Iterable[tuple[int, int, int]], n: int, *, engine: str) -> list[int]:
    """One weight version per completion token from an engine's ``(version, start, end)`` spans
    (end exclusive). Never guesses: RuntimeError unless the spans cover exactly ``n`` tokens (a
    version the engine did not report would hide stale tokens)."""
    versions: list[int] = []
    for version, start, end in spans:
        versions.extend([version] * (end - start))
    if len(versions) != n:
        raise RuntimeError(f"{engine} reported weight-version spans for {len(versions)} of {n} tokens")
    return versions


class StopRule:
    """vLLM's stop rule over token ids, for engines that give ids only: a sequence stops once its decoded text (with the
    request's ``skip_special_tokens``) holds a stop string; the text ends before it (after it
    with ``include_stop_str_in_output``). The token that completed it stays in the token ids.
    Where several are found, the one that ends first cuts (ties: the first listed), as vLLM. With
    ``min_tokens``, only a stop string that ends past the text of the first ``min_tokens`` tokens
    counts, and none before more than ``min_tokens`` tokens (vLLM's detokenizer)."""

    def __init__(self, tokenizer: Any, req: SamplingRequest) -> None:
        self.tokenizer, self.stops = tokenizer, req.stop_strings
        self.skip_special, self.include = req.skip_special_tokens, req.include_stop_str_in_output
        self.stop_token_ids = frozenset(req.stop_token_ids or ())
        self.min_tokens = req.min_tokens

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special))

    def floor(self, token_ids: Sequence[int]) -> int | None:
        """Where a stop string must end past: the length of the first ``min_tokens`` tokens'
        text (its partial last character not yet counted, as vLLM's detokenizer has not emitted
        it); None while ``token_ids`` are not more than ``min_tokens`` (no stop string counts yet)."""
        if len(token_ids) <= self.min_tokens:
            return None
        return len(self.decode(token_ids[: self.min_tokens]).rstrip("\ufffd")) if self.min_tokens else 0

    def hit(self, token_ids: Sequence[int]) -> bool:
        """Whether the text of ``token_ids`` holds a stop string that counts (checked after every token)."""
        floor = self.floor(token_ids) if self.stops else None
        return floor is not None and self.find(self.decode(token_ids), floor) is not None

    def find(self, text: str, floor: int = 0) -> tuple[int, str] | None:
        """(where, which) of the stop string in ``text`` that ends first past ``floor`` (ties: the
        first listed); None if none does."""
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            at = text.find(s, max(0, floor - len(s) + 1))
            if at >= 0 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at, s)
        return None if best is None else (best[1], best[2])

    def finish(
        self, token_ids: Sequence[int], finish_reason: FinishReason, stop_ids: frozenset[int]
    ) -> tuple[str, str | int | None]:
        """(text, stop_reason) of a finished sequence: cut at the stop string that counts; a stop
        token's own text left out unless ``include_stop_str_in_output`` (as vLLM). ``stop_ids``
        are the ids that ended the request (EOS unless ignored, ``stop_token_ids``). A partial
        UTF-8 character that ends the text (U+FFFD: its last bytes never came) is dropped, as
        vLLM's detokenizer drops it, so the text never ends with what a stream holds back."""
        ids = list(token_ids)
        if finish_reason == "stop" and ids and ids[-1] in stop_ids:
            text = self.decode(ids if self.include else ids[:-1]).rstrip("\ufffd")
            return text, ids[-1] if ids[-1] in self.stop_token_ids else None
        return self.cut(self.decode(ids).rstrip("\ufffd"), self.floor(ids))

    def cut(self, text: str, floor: int | None = 0) -> tuple[str, str | None]:
        """(``text`` cut at the stop string that counts past ``floor`` (:meth:`find`), that stop
        string); ``(text, None)`` if it holds none. ``floor`` None: none counts yet."""
        found = None if floor is None else self.find(text, floor)
        if found is None:
            return text, None
        at, stop = found
        return text[: at + (len(stop) if self.include else 0)], stop


def prompt_entries(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    logprobs: Sequence[float | None],
    ranks: Sequence[int | None] | None = None,
    tops: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then ``{id: {logprob, rank,
    decoded_token}}`` for the prompt token and its best alternatives (``tops[i]``, with their
    rank by order). ``ranks`` None: the engine does not report the prompt token's rank."""
    out: list[dict[int, PromptLogprob] | None] = [None]
    for i in range(1, len(prompt_ids)):
        lp = logprobs[i]
        if lp is None:
            out.append(None)
            continue
        entry: dict[int, PromptLogprob] = {}
        for r, (tid, tlp) in enumerate((tops[i] if tops is not None else ()), start=1):
            entry[int(tid)] = PromptLogprob(logprob=float(tlp), rank=r, decoded_token=str(tokenizer.decode([tid])))
        tid = int(prompt_ids[i])
        rank = ranks[i] if ranks is not None else None
        entry[tid] = PromptLogprob(logprob=float(lp), rank=rank, decoded_token=str(tokenizer.decode([tid])))
        out.append(entry)
    return out


def assemble_choice(
    tokenizer: Any,
    index: int,
    req: ChatCompletionRequest,
    *,
    text: str,
    token_ids: Sequence[int],
    versions: Sequence[int],
    finish_reason: FinishReason,
    logprobs: Sequence[float] = (),
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    stop_reason: str | int | None = None,
    tool_parser: str | None = None,
) -> ChatChoice:
    """One choice: ``logprobs`` (raw, one per token) and ``top_logprobs`` (``(id, logprob)`` best
    first, already cut to the request's count) are reported only if the request asked; tool
    calls forced by ``tool_choice`` or parsed by ``tool_parser``
    (:func:`~pipelinerl_sdk.kit.inference.tools.choice_tool_calls`)."""
    content, calls, finish = choice_tool_calls(req, text, finish_reason, tool_parser)
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=content, tool_calls=calls),
        finish_reason=finish,  # type: ignore[arg-type]
        stop_reason=stop_reason,
        logprobs=choice_logprobs(tokenizer, token_ids, logprobs, top_logprobs, as_ids=req.return_tokens_as_token_ids)
        if req.logprobs
        else None,
        token_ids=list(token_ids) if req.return_token_ids else None,
        weight_versions=list(versions),
    )


def assemble_response(
    model: str,
    req: ChatCompletionRequest,
    plan: ChatPlan,
    choices: Sequence[ChatChoice],
    *,
    completion_tokens: int,
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None,
) -> ChatCompletionResponse:
    """The response: usage counted, prompt token ids and prompt logprobs only if asked."""
    prompt = plan.prompt_ids
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=list(choices),
        usage=Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt) + completion_tokens,
        ),
        prompt_token_ids=list(prompt) if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs if req.prompt_top is not None else None,
    )
