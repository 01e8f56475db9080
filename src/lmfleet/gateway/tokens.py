"""Counting prompt tokens with the model's own tokenizer (for the context-length check and the ledger)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("lmfleet.gateway")

# prompts longer than this many characters are tokenized in a worker thread, off the event loop
_OFFLOAD_CHARS = 16_000


def load_tokenizer(path: str) -> Any | None:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # the gateway still serves; only the early context-length check is lost
        log.warning("could not load tokenizer from %s (%s); prompt lengths are left to the engine", path, e)
        return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _ids_len(x: Any) -> int:
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    if x and isinstance(x[0], list):
        x = x[0]
    return len(x)


def count_chat(tok: Any, messages: list[dict[str, Any]]) -> int:
    msgs = [{"role": m.get("role"), "content": _text_of(m.get("content"))} for m in messages]
    try:
        return _ids_len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    except Exception:
        # no/odd template: count the text itself (a lower bound; the engine has the last word)
        return sum(len(tok.encode(m["content"], add_special_tokens=False)) for m in msgs)


def count_completion(tok: Any, prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(tok.encode(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return len(prompt)
        return max(count_completion(tok, p) if not isinstance(p, list) else len(p) for p in prompt)
    return 0


def _size(kind: str, body: dict[str, Any]) -> int:
    if kind == "chat":
        return sum(len(_text_of(m.get("content"))) for m in body.get("messages", []) if isinstance(m, dict))
    p = body.get("prompt")
    return len(p) if isinstance(p, str) else sum(len(x) for x in p if isinstance(x, str)) if isinstance(p, list) else 0


async def count_prompt_tokens(tok: Any | None, kind: str, body: dict[str, Any]) -> int | None:
    if tok is None:
        return None
    fn = count_chat if kind == "chat" else count_completion
    arg = body.get("messages") if kind == "chat" else body.get("prompt")
    if _size(kind, body) > _OFFLOAD_CHARS:
        return await asyncio.to_thread(fn, tok, arg)
    return fn(tok, arg)
