"""Counting prompt tokens with the model's own tokenizer (for the context-length check and the ledger)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lmfleet.models.tokenizer import TokenizerLoadError, load_tokenizer

log = logging.getLogger("lmfleet.gateway")

# prompts longer than this many characters are tokenized in a worker thread, off the event loop
_OFFLOAD_CHARS = 16_000


def load_tokenizer_or_none(path: str, *, trust_remote_code: bool = False) -> Any | None:
    """The model's tokenizer, or None (with a warning): the gateway still serves, only the early
    context-length check is lost."""
    try:
        return load_tokenizer(path, trust_remote_code=trust_remote_code, local_files_only=False)
    except TokenizerLoadError as e:
        log.warning("%s; prompt lengths are left to the engine", e)
        return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
    return ""


def _ids_len(x: Any) -> int:
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    if x and isinstance(x[0], list):
        x = x[0]
    return len(x)


def _fast_count(tok: Any, text: str) -> int | None:
    """Tokens of ``text`` (no special tokens added) by the Rust tokenizer's ``encode_batch_fast``, which skips
    offsets and Python-side encodings: about half the time of the tokenizer's ``__call__``, and the GIL is
    released while it runs. None where the tokenizer has no such backend."""
    fast = getattr(getattr(tok, "_tokenizer", None), "encode_batch_fast", None)
    if fast is None:
        return None
    return len(fast([text], add_special_tokens=False)[0])


def count_chat(tok: Any, messages: list[dict[str, Any]]) -> int:
    msgs = [{"role": m.get("role"), "content": _text_of(m.get("content"))} for m in messages]
    try:
        # the rendered template carries its own special tokens, as apply_chat_template(tokenize=True) counts them
        n = _fast_count(tok, tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
        if n is not None:
            return n
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


# a chat template's own tokens per message beyond its role and text: role markers, separators (generous)
_PER_MESSAGE = 16


def template_overhead(tok: Any) -> int:
    """Tokens a chat template adds around one empty user message (default system prompt, generation
    prompt included): the fixed part of :func:`token_bounds`. 0 without a template."""
    try:
        return _ids_len(tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                                tokenize=True))
    except Exception:
        return 0


def utf8_len(text: str) -> int:
    """The text's length in UTF-8 bytes; without encoding it when it is ASCII (the common case). Pure."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def token_bounds(kind: str, body: dict[str, Any], overhead: int) -> tuple[int, int] | None:
    """(upper bound, rough estimate) of the prompt's tokens without tokenizing, or None when the prompt is not
    plain text (token ids, odd content). Pure.

    Why the bound holds: every token of a byte-level BPE covers at least one UTF-8 byte of the text, and a
    SentencePiece token at least one character (byte fallback: one byte). So text tokens <= UTF-8 bytes (+1 for
    a word-boundary prefix), and a chat template adds at most ``overhead`` + ``_PER_MESSAGE`` per message + the
    role's own text. (A normalizer that expands characters, NFKC's ligatures, can beat it; the engine still
    rejects what does not fit.) The estimate (4 bytes a token) stands in for the count until it is known.
    """
    if kind == "chat":
        size, fixed = 0, overhead
        for m in body.get("messages") or ():
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                return None
            role = m.get("role") if isinstance(m.get("role"), str) else ""
            size += utf8_len(_text_of(content))
            fixed += _PER_MESSAGE + utf8_len(role) + 1
        return size + fixed, size // 4 + overhead
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        n = utf8_len(prompt)
        return n + 2, n // 4 + 1
    return None
