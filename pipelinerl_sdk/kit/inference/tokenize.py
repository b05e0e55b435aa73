"""``/tokenize`` and ``/detokenize`` with the tokenizer the kit generates with (vLLM 0.32's
routes and shapes): the ids a chat or a completions prompt is generated from, and the text of
ids."""

from __future__ import annotations

from typing import Any

from pipelinerl_sdk.errors import InvalidRequest
from pipelinerl_sdk.kit.inference.chat import render_text
from pipelinerl_sdk.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)


def tokenize(
    tokenizer: Any, req: TokenizeCompletionRequest | TokenizeChatRequest, max_model_len: int
) -> TokenizeResponse:
    """The ids the generation routes would use for ``req``'s prompt: a chat's messages through
    the chat template (as :func:`~pipelinerl_sdk.kit.inference.chat.render_prompt`), a text
    prompt with the model's special tokens unless ``add_special_tokens`` is false. No length
    limit (vLLM's neither): ``count`` tells the caller whether it fits ``max_model_len``."""
    if isinstance(req, TokenizeChatRequest):
        kwargs = dict(req.chat_template_kwargs or {})
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        chat = ChatCompletionRequest(
            messages=req.messages,
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=kwargs or None,
            tools=req.tools,
        )
        text = render_text(tokenizer, chat)
    else:
        text = req.prompt
    ids = [int(t) for t in tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]]
    strs = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(tokenizer: Any, req: DetokenizeRequest, vocab_size: int | None) -> DetokenizeResponse:
    """The text of ``req.tokens`` (special tokens kept, as vLLM's decode); an id outside the
    vocabulary is InvalidRequest naming ``tokens``."""
    size = vocab_size if vocab_size is not None else len(tokenizer)
    bad = [t for t in req.tokens if t >= size]
    if bad:
        raise InvalidRequest(f"tokens: ids {bad[:8]} are outside the vocabulary (size {size})", field="tokens")
    return DetokenizeResponse(prompt=str(tokenizer.decode(req.tokens)))
