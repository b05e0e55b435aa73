"""Admission of chat requests: a server takes at most so many requests, and so many completion
tokens, at once; past either bound a request is refused at once (:class:`Overloaded`, 429 with
``Retry-After``) instead of queueing without end behind work it cannot reach. A request whose own
budget is past the token bound can never be admitted: a 400 naming ``max_tokens`` or ``n``,
whatever else runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pipelinerl_sdk.contracts import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_TOKENS_IN_FLIGHT,
    ServeConfig,
)
from pipelinerl_sdk.errors import InvalidRequest, Overloaded
from pipelinerl_sdk.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True, slots=True)
class Limits:
    """What one server admits: bodies up to ``max_body_bytes``; at most ``max_requests`` chat
    requests and ``max_tokens`` completion tokens (:func:`chat_cost`) at once."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    max_tokens: int = DEFAULT_MAX_TOKENS_IN_FLIGHT

    @classmethod
    def of(cls, config: ServeConfig) -> Limits:
        return cls(config.max_body_bytes, config.max_queued_requests, config.max_tokens_in_flight)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_requests", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


#: The budget counted for a request without ``max_tokens`` when the backend reports no context
#: length (with one, such a request may generate to the context's end, and that is counted).
UNKNOWN_CONTEXT_BUDGET = 256


def chat_cost(req: ChatCompletionRequest | CompletionRequest, default_budget: int) -> int:
    """The completion tokens ``req`` may generate: ``n`` times its token budget (or
    ``default_budget``, the room a request without one may fill, when it names none), times
    its prompts (a completions batch)."""
    prompts = len(req.prompts()) if isinstance(req, CompletionRequest) else 1
    return prompts * req.n * (req.token_budget or default_budget)


def cost_field(req: ChatCompletionRequest | CompletionRequest, default_budget: int, bound: int) -> str:
    """The field to name when ``req``'s cost is past ``bound``: ``n`` where one sample of each
    prompt would fit, else ``max_tokens``."""
    one = chat_cost(req.model_copy(update={"n": 1}), default_budget)
    return "n" if req.n > 1 and one <= bound else "max_tokens"


class Admission:
    """The requests and tokens admitted now. Event-loop only (not thread-safe)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.requests = 0
        self.tokens = 0

    @contextmanager
    def admit(self, cost: int, *, field: str = "max_tokens") -> Iterator[None]:
        """Hold ``cost`` tokens and one request slot for the block; :class:`Overloaded` (nothing
        held) past a bound now. A ``cost`` past the token bound itself can never be admitted:
        :class:`InvalidRequest` naming ``field`` (the request's, :func:`cost_field`)."""
        lim = self.limits
        if cost > lim.max_tokens:
            raise InvalidRequest(
                f"{field}: this request may generate {cost} tokens (prompts x n x max_tokens, or the context "
                f"length without max_tokens), past this server's bound of {lim.max_tokens} tokens in flight; "
                "it can never be admitted: ask for fewer",
                field=field,
            )
        if self.requests >= lim.max_requests:
            raise Overloaded(f"server busy: {self.requests} requests in flight (limit {lim.max_requests}); retry later")
        if self.tokens and self.tokens + cost > lim.max_tokens:
            raise Overloaded(
                f"server busy: {self.tokens} tokens in flight + {cost} asked is past the limit of {lim.max_tokens}; "
                "retry later"
            )
        self.requests += 1
        self.tokens += cost
        try:
            yield
        finally:
            self.requests -= 1
            self.tokens -= cost
