"""A request as every layer of the gateway reads it once the front door has parsed it (:class:`ParsedRequest`),
and the context-length check that routing (the exact prompt count) and the front door (a bound) both apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lmfleet.gateway.core.errors import GatewayError

Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    model: str
    body: dict[str, Any]
    stream: bool
    max_tokens: int | None
    wants_usage: bool
    """The client asked for usage in the stream (stream_options.include_usage)."""


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Reject prompts that cannot fit: prompt + max_tokens must stay within max_model_len."""
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            raise GatewayError(
                400,
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                f"{prompt_tokens} tokens, which leaves no room for output. Shorten the prompt.",
                param="messages", code="context_length_exceeded")
        return
    if prompt_tokens + max_tokens > max_model_len:
        raise GatewayError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt and {max_tokens} for the "
            f"completion). Reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
