"""Workload mixes: named request classes with weights and token-length distributions.

A mix is data (``WorkloadMix``); sampling is a pure function of (mix, seed, tokenizer). Prompts are
synthesised to an exact token count with the target model's tokenizer, so ``prompt_tokens`` in the
server's ``usage`` equals the number we asked for (see ``PromptSynthesizer``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml


class BenchInputError(ValueError):
    """Bad benchmark input (mix, options, target); the CLI prints it and exits 2 before any load is sent."""


API_KINDS = ("chat", "completion")


@dataclass(frozen=True)
class TokenDist:
    """A distribution of token counts: ``fixed`` (lo == hi), ``uniform`` integers in [lo, hi], or
    ``normal`` (mean, std) clipped to [lo, hi]."""

    lo: int
    hi: int
    kind: Literal["uniform", "normal"] = "uniform"
    mean: float = 0.0
    std: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "normal":
            return int(min(self.hi, max(self.lo, round(rng.gauss(self.mean, self.std)))))
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    weight: float
    input_tokens: TokenDist
    output_tokens: TokenDist
    api: Literal["chat", "completion"] = "chat"
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens (do not send it to other servers)


@dataclass(frozen=True)
class WorkloadMix:
    classes: tuple[WorkloadClass, ...]
    seed: int = 0

    @property
    def max_total_tokens(self) -> int:
        return max(c.input_tokens.hi + c.output_tokens.hi for c in self.classes)


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: either ``prompt`` (completion) or ``messages`` (chat)."""

    cls: str
    api: str
    input_tokens: int  # expected prompt tokens (0 = unknown, e.g. dataset without a tokenizer)
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = field(default=None)
    ignore_eos: bool = False


# ---------------------------------------------------------------- parsing


def parse_token_dist(value: Any, where: str) -> TokenDist:
    """``128`` | ``"64-512"`` | ``{min: 64, max: 512}`` | ``{dist: normal, mean, std, min, max}``."""
    kind_error = ""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            lo = hi = value
            d = TokenDist(lo, hi)
        elif isinstance(value, str):
            parts = value.replace(" ", "").split("-")
            if len(parts) == 1:
                lo = hi = int(parts[0])
            elif len(parts) == 2:
                lo, hi = int(parts[0]), int(parts[1])
            else:
                raise ValueError
            d = TokenDist(lo, hi)
        elif isinstance(value, dict):
            kind = value.get("dist", "uniform")
            lo, hi = int(value["min"]), int(value["max"])
            if kind == "normal":
                d = TokenDist(lo, hi, kind, float(value.get("mean", (lo + hi) / 2)),
                              float(value.get("std", (hi - lo) / 4)))
            elif kind == "uniform":
                d = TokenDist(lo, hi)
            else:
                kind_error = f"{where}: dist={kind!r}; expected 'uniform' or 'normal'"
                raise TypeError
        else:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        if kind_error:
            raise BenchInputError(kind_error) from None
        raise BenchInputError(
            f"{where}: {value!r} is not a token count; expected N, 'LO-HI', {{min: LO, max: HI}} "
            "or {dist: normal, mean: M, std: S, min: LO, max: HI}") from None
    if not 1 <= d.lo <= d.hi:
        raise BenchInputError(f"{where}: range {d.lo}-{d.hi} is invalid; need 1 <= LO <= HI")
    return d


def mix_from_dict(data: dict[str, Any], source: str = "mix") -> WorkloadMix:
    if not isinstance(data, dict) or not isinstance(data.get("classes"), list) or not data["classes"]:
        raise BenchInputError(f"{source}: expected a mapping with a non-empty 'classes' list")
    unknown = set(data) - {"classes", "seed"}
    if unknown:
        raise BenchInputError(f"{source}: unknown key(s) {sorted(unknown)}; expected 'classes' and 'seed'")
    allowed = {"name", "weight", "input_tokens", "output_tokens", "api", "ignore_eos"}
    classes = []
    for i, c in enumerate(data["classes"]):
        where = f"{source}: classes[{i}]"
        if not isinstance(c, dict) or "name" not in c:
            raise BenchInputError(f"{where}: expected a mapping with 'name', 'weight', 'input_tokens', 'output_tokens'")
        where = f"{source}: class {c['name']!r}"
        if set(c) - allowed:
            raise BenchInputError(f"{where}: unknown key(s) {sorted(set(c) - allowed)}; allowed: {sorted(allowed)}")
        for key in ("weight", "input_tokens", "output_tokens"):
            if key not in c:
                raise BenchInputError(f"{where}: missing '{key}'")
        api = c.get("api", "chat")
        if api not in API_KINDS:
            raise BenchInputError(f"{where}: api={api!r}; expected one of {API_KINDS}")
        try:
            weight = float(c["weight"])
        except (TypeError, ValueError):
            raise BenchInputError(f"{where}: weight={c['weight']!r} is not a number") from None
        classes.append(WorkloadClass(
            name=str(c["name"]), weight=weight,
            input_tokens=parse_token_dist(c["input_tokens"], f"{where}.input_tokens"),
            output_tokens=parse_token_dist(c["output_tokens"], f"{where}.output_tokens"),
            api=api, ignore_eos=bool(c.get("ignore_eos", False))))
    mix = WorkloadMix(tuple(classes), seed=int(data.get("seed", 0)))
    validate_mix(mix, source)
    return mix


def parse_mix_inline(text: str) -> WorkloadMix:
    """``NAME:WEIGHT:IN:OUT[:API],...`` e.g. ``short:0.6:64-512:32-256:chat,long:0.4:4096-8192:512``."""
    classes = []
    for i, item in enumerate(x for x in text.split(",") if x.strip()):
        parts = item.strip().split(":")
        if len(parts) not in (4, 5):
            raise BenchInputError(
                f"--mix item {item!r}: expected NAME:WEIGHT:INPUT_TOKENS:OUTPUT_TOKENS[:chat|completion]")
        c = {"name": parts[0], "weight": parts[1], "input_tokens": parts[2], "output_tokens": parts[3]}
        if len(parts) == 5:
            c["api"] = parts[4]
        classes.append(c)
    return mix_from_dict({"classes": classes}, "--mix")


def load_mix(spec: str) -> WorkloadMix:
    """A YAML/JSON file path or an inline spec (see ``parse_mix_inline``)."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise BenchInputError(f"mix file {spec} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise BenchInputError(f"mix file {spec}: not valid YAML/JSON: {e}") from None
        return mix_from_dict(data, str(path))
    return parse_mix_inline(spec)


def validate_mix(mix: WorkloadMix, source: str = "mix") -> None:
    names = [c.name for c in mix.classes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BenchInputError(f"{source}: duplicate class name(s) {dupes}")
    if any(c.weight <= 0 for c in mix.classes):
        bad = {c.name: c.weight for c in mix.classes if c.weight <= 0}
        raise BenchInputError(f"{source}: weights must be > 0, got {bad}")
    total = sum(c.weight for c in mix.classes)
    if abs(total - 1.0) > 1e-3 and abs(total - 100.0) > 1e-1:
        raise BenchInputError(
            f"{source}: class weights sum to {total:g} ({', '.join(f'{c.name}={c.weight:g}' for c in mix.classes)}); "
            "they must sum to 1 (or 100 as percentages)")


def with_weights(mix: WorkloadMix, overrides: dict[str, float]) -> WorkloadMix:
    """Apply ``--weight NAME=W`` overrides; unknown names are an error."""
    known = {c.name for c in mix.classes}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise BenchInputError(f"--weight: unknown class name(s) {unknown}; the mix has {sorted(known)}")
    classes = tuple(
        WorkloadClass(c.name, overrides.get(c.name, c.weight), c.input_tokens, c.output_tokens, c.api, c.ignore_eos)
        for c in mix.classes)
    new = WorkloadMix(classes, mix.seed)
    validate_mix(new, "--weight")
    return new


def check_context(mix: WorkloadMix, max_model_len: int | None) -> None:
    if not max_model_len:
        return
    for c in mix.classes:
        need = c.input_tokens.hi + c.output_tokens.hi
        if need > max_model_len:
            raise BenchInputError(
                f"class {c.name!r}: input up to {c.input_tokens.hi} + output up to {c.output_tokens.hi} = {need} "
                f"tokens exceeds the model's context ({max_model_len=}); lower the ranges")


# ---------------------------------------------------------------- sampling


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def pick_class(mix: WorkloadMix, rng: random.Random) -> WorkloadClass:
    return rng.choices(mix.classes, weights=[c.weight for c in mix.classes], k=1)[0]


def sample_requests(mix: WorkloadMix, n: int, synth: "PromptSynthesizer",
                    seed: int | None = None) -> list[BenchRequest]:
    """``n`` requests drawn from the mix; the same (mix, n, seed, tokenizer) gives the same list."""
    rng = random.Random(mix.seed if seed is None else seed)
    out = []
    for _ in range(n):
        c = pick_class(mix, rng)
        n_in, n_out = c.input_tokens.sample(rng), c.output_tokens.sample(rng)
        if c.api == "chat":
            out.append(BenchRequest(c.name, "chat", n_in, n_out, messages=synth.chat(n_in, rng),
                                    ignore_eos=c.ignore_eos))
        else:
            out.append(BenchRequest(c.name, "completion", n_in, n_out, prompt=synth.completion(n_in, rng),
                                    ignore_eos=c.ignore_eos))
    return out


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
