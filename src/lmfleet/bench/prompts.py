"""Requests from a mix, a dataset or a trace: sampling, prompt synthesis and multi-turn sessions.

Sampling is a pure function of (mix, seed, tokenizer). Prompts are synthesised to an exact token count with the
target model's tokenizer, so ``prompt_tokens`` in the server's ``usage`` equals the number we asked for (see
``PromptSynthesizer``). A timed trace (:mod:`lmfleet.bench.trace`, :mod:`lmfleet.bench.replay`) becomes requests
of its recorded lengths through ``trace_requests``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lmfleet.bench.mix import BenchInputError, BenchRequest, WorkloadClass, WorkloadMix
from lmfleet.bench.trace import TraceRequest


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def pick_class(mix: WorkloadMix, rng: random.Random) -> WorkloadClass:
    return rng.choices(mix.classes, weights=[c.weight for c in mix.classes], k=1)[0]


def sample_requests(mix: WorkloadMix, n: int, synth: "PromptSynthesizer",
                    seed: int | None = None) -> list[BenchRequest]:
    """``n`` requests drawn from the mix; the same (mix, n, seed, tokenizer) gives the same list."""
    rng = random.Random(mix.seed if seed is None else seed)
    out = []
    sessions = SessionBook(mix, synth, rng)
    for _ in range(n):
        c = pick_class(mix, rng)
        n_in, n_out = c.input_tokens.sample(rng), c.output_tokens.sample(rng)
        if c.has_sessions:
            out.append(sessions.next_turn(c, n_in, n_out))
        elif c.api == "chat":
            out.append(BenchRequest(c.name, "chat", n_in, n_out, messages=synth.chat(n_in, rng),
                                    ignore_eos=c.ignore_eos))
        else:
            out.append(BenchRequest(c.name, "completion", n_in, n_out, prompt=synth.completion(n_in, rng),
                                    ignore_eos=c.ignore_eos))
    return out


@dataclass
class _Session:
    number: int
    prefix: int | None
    history: list[dict[str, str]]
    turns_done: int = 0


class SessionBook:
    """The open sessions of every session class, and each class's pool of system prompts.

    Each request of a class picks one of its ``sessions`` slots at random; an empty or finished slot starts a
    new session there. A turn appends the user text and a synthetic reply (``max_tokens`` words) to the
    history, so the next turn's prompt starts with this one's. Pure: everything comes from ``rng``.
    """

    def __init__(self, mix: WorkloadMix, synth: "PromptSynthesizer", rng: random.Random):
        self.synth = synth
        self.rng = rng
        self.pools = {c.name: [synth.text(c.prefixes.tokens, rng) for _ in range(c.prefixes.count)]
                      for c in mix.classes if c.prefixes is not None}
        self.slots: dict[str, list[_Session | None]] = {c.name: [None] * c.sessions for c in mix.classes}
        self.started: dict[str, int] = {c.name: 0 for c in mix.classes}

    def next_turn(self, c: WorkloadClass, n_in: int, n_out: int) -> BenchRequest:
        slots = self.slots[c.name]
        k = self.rng.randrange(len(slots))
        s = slots[k]
        if s is None or s.turns_done >= c.turns:
            prefix = c.prefixes.pick(self.rng) if c.prefixes else None
            system = [{"role": "system", "content": self.pools[c.name][prefix]}] if prefix is not None else []
            s = slots[k] = _Session(self.started[c.name], prefix, system)
            self.started[c.name] += 1
        user = {"role": "user", "content": self.synth.text(n_in, self.rng)}
        messages = [*s.history, user]
        s.history = [*messages, {"role": "assistant", "content": self.synth.text(n_out, self.rng)}]
        s.turns_done += 1
        common = dict(ignore_eos=c.ignore_eos, session=f"{c.name}/{s.number}", turn=s.turns_done, prefix=s.prefix)
        if c.api == "chat":
            return BenchRequest(c.name, "chat", self.synth.count_messages(messages), n_out, messages=messages,
                                **common)
        prompt = "".join(m["content"] for m in messages)
        return BenchRequest(c.name, "completion", self.synth.count_completion(prompt), n_out, prompt=prompt, **common)


class PromptSynthesizer:
    """Builds prompts of an exact token count from words that are single tokens with a leading space.

    With byte-level BPE (GPT-2 style pre-tokenisation splits before each space) such words concatenate
    without merging, so ``k`` words are ``k`` tokens; the result is verified and adjusted anyway.
    """

    def __init__(self, tokenizer: Any, max_vocab_scan: int = 20000):
        self.tok = tokenizer
        vocab_size = len(tokenizer)
        words = []
        for tid in range(min(vocab_size, max_vocab_scan)):
            s = tokenizer.decode([tid])
            if len(s) > 2 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
                words.append(s)
        words = [w for w in words[:4000] if len(tokenizer.encode(w, add_special_tokens=False)) == 1]
        if len(words) < 8:
            raise BenchInputError("the tokenizer has too few single-token words to synthesise prompts; "
                                  "use --dataset instead")
        self.words = words
        self._special = len(tokenizer.encode("", add_special_tokens=True))
        self._chat_overhead: int | None = None

    def count_completion(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=True))

    def count_chat(self, content: str) -> int:
        ids = self.tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                           add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return len(ids)

    def count_messages(self, messages: list[dict[str, str]]) -> int:
        ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return len(ids)

    def min_tokens(self, api: str) -> int:
        """The shortest prompt this API can be given: its fixed overhead (chat template, special tokens) + 1."""
        if api == "chat":
            if self._chat_overhead is None:
                self._chat_overhead = self.count_chat("a") - 1
            return self._chat_overhead + 1
        return self._special + 1

    def text(self, n: int, rng: random.Random) -> str:
        """``n`` single-token words (``n`` tokens on their own; a neighbour may merge at the edges)."""
        return "".join(rng.choices(self.words, k=n))

    def completion(self, n: int, rng: random.Random) -> str:
        return self._fit_with_offset(n, self._special, self.count_completion, rng)

    def chat(self, n: int, rng: random.Random) -> list[dict[str, str]]:
        if self._chat_overhead is None:
            self._chat_overhead = self.count_chat("a") - 1
        return [{"role": "user", "content": self._fit_with_offset(n, self._chat_overhead, self.count_chat, rng)}]

    def _fit_with_offset(self, n: int, overhead: int, count, rng: random.Random) -> str:
        if n <= overhead:
            raise BenchInputError(f"{n} input tokens is below this API's fixed prompt overhead ({overhead} tokens)")
        words = rng.choices(self.words, k=n - overhead)
        for _ in range(16):  # the first word or the template boundary may merge; trim/extend at the end
            text = "".join(words)
            got = count(text)
            if got == n:
                return text
            if got > n:
                del words[max(1, len(words) - (got - n)):]
            else:
                words += rng.choices(self.words, k=n - got)
        raise BenchInputError(f"could not synthesise a prompt of exactly {n} tokens with this tokenizer")


# ---------------------------------------------------------------- datasets


def load_dataset(path: Path, n: int, seed: int, tokenizer: Any | None, max_tokens_default: int = 256,
                 api: str = "chat") -> list[BenchRequest]:
    """ShareGPT JSON (``[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]``) or
    JSONL with ``{"prompt": ..., "max_tokens": N}`` per line. Samples ``n`` entries (with replacement if short)."""
    if not path.is_file():
        raise BenchInputError(f"dataset {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchInputError(f"dataset {path}: not valid JSON/JSONL: {e}") from None
    items: list[tuple[str, int]] = []
    for row in rows if isinstance(rows, list) else []:
        conv = row.get("conversations") if isinstance(row, dict) else None
        if conv and len(conv) >= 1 and conv[0].get("value"):
            reply = conv[1].get("value", "") if len(conv) > 1 else ""
            out = len(tokenizer.encode(reply, add_special_tokens=False)) if tokenizer and reply else max_tokens_default
            items.append((conv[0]["value"], max(out, 1)))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            items.append((row["prompt"], int(row.get("max_tokens", max_tokens_default))))
    if not items:
        raise BenchInputError(f"dataset {path}: no usable entries (expected ShareGPT 'conversations' or 'prompt')")
    rng = random.Random(seed)
    picks = rng.sample(items, n) if n <= len(items) else rng.choices(items, k=n)
    out = []
    for prompt, max_tokens in picks:
        n_in = len(tokenizer.encode(prompt)) if tokenizer else 0
        if api == "chat":
            out.append(BenchRequest("dataset", "chat", n_in, max_tokens,
                                    messages=[{"role": "user", "content": prompt}]))
        else:
            out.append(BenchRequest("dataset", "completion", n_in, max_tokens, prompt=prompt))
    return out


# ---------------------------------------------------------------- traces


def trace_requests(trace: Sequence[TraceRequest], synth: PromptSynthesizer, api: str = "chat", seed: int = 0,
                   ignore_eos: bool = False) -> list[BenchRequest]:
    """One request per trace entry, with a prompt of exactly its ``prompt_tokens`` (at least the API's fixed
    overhead + 1: :meth:`PromptSynthesizer.min_tokens`) and ``max_tokens`` its ``output_tokens``. ``ignore_eos``
    (vLLM only): generate the recorded output length even where the model would stop earlier."""
    if api not in ("chat", "completion"):
        raise BenchInputError(f"trace api {api!r}: expected chat or completion")
    rng = random.Random(seed)
    floor = synth.min_tokens(api)
    out = []
    for r in trace:
        n = max(r.prompt_tokens, floor)
        if api == "chat":
            out.append(BenchRequest(r.kind, "chat", n, r.output_tokens, messages=synth.chat(n, rng),
                                    ignore_eos=ignore_eos))
        else:
            out.append(BenchRequest(r.kind, "completion", n, r.output_tokens, prompt=synth.completion(n, rng),
                                    ignore_eos=ignore_eos))
    return out
