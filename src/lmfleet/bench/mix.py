"""Workload mixes: named request classes with weights and token-length distributions, and their parsing.

A mix is data (``WorkloadMix``); it comes from a YAML/JSON file or an inline spec (``load_mix``) and is checked
before any load is sent (``validate_mix``, ``check_context``). Sampling requests from it is
:mod:`lmfleet.bench.prompts`.

Shared-prefix workloads, for measuring prefix caching and cache-aware routing (docs/routing.md): a class may
draw each session's system prompt from a pool of K prompts of P tokens (``system_prompts``, optionally with
one hot prompt taking ``hot_share`` of the sessions) and run ``turns``-turn sessions in which every turn
carries the conversation so far (system prompt, earlier user turns and a synthetic assistant reply of each
turn's ``max_tokens`` words), so turn k+1's prompt starts with turn k's.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from lmfleet.errors import LmfleetError



class BenchInputError(LmfleetError, ValueError):
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
    prefixes: "PrefixPool | None" = None
    """Shared system prompts: each session starts with one of them (None: no system prompt)."""
    turns: int = 1
    """Turns per session; each turn's prompt holds the whole conversation so far."""
    sessions: int = 8
    """Sessions of this class open at once; requests pick one of them at random, so turns interleave."""

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt (before the chat template): system prompt, every turn's input, earlier replies."""
        prefix = self.prefixes.tokens if self.prefixes else 0
        return prefix + self.turns * self.input_tokens.hi + (self.turns - 1) * self.output_tokens.hi

    @property
    def has_sessions(self) -> bool:
        return self.prefixes is not None or self.turns > 1


@dataclass(frozen=True)
class PrefixPool:
    """``count`` distinct system prompts of ``tokens`` tokens; ``hot_share`` of sessions use prompt 0 (the rest
    draw uniformly from all, prompt 0 included): 0 is a uniform pool, 0.9 one hot prefix."""

    count: int
    tokens: int
    hot_share: float = 0.0

    def pick(self, rng: random.Random) -> int:
        return 0 if rng.random() < self.hot_share else rng.randrange(self.count)


@dataclass(frozen=True)
class WorkloadMix:
    classes: tuple[WorkloadClass, ...]
    seed: int = 0

    @property
    def max_total_tokens(self) -> int:
        return max(c.max_prompt_tokens + c.output_tokens.hi for c in self.classes)


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
    session: str = ""  # "" = not part of a session; else the class and a session number
    turn: int = 0  # 1-based within the session (0: no session)
    prefix: int | None = None  # index of the shared system prompt in the class's pool


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


def _positive_int(value: Any, where: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() \
            or not 1 <= int(value) <= most:
        raise BenchInputError(f"{where}: {value!r} is not a whole number from 1 to {most}")
    return int(value)


def parse_prefix_pool(value: Any, where: str) -> PrefixPool:
    """``{count: K, tokens: P, hot_share: H}`` or ``"KxP"`` (e.g. ``8x1000``)."""
    if isinstance(value, str):
        k, _, p = value.lower().partition("x")
        value = {"count": k, "tokens": p}
    if not isinstance(value, dict) or set(value) - {"count", "tokens", "hot_share"} or not {"count", "tokens"} <= set(value):
        raise BenchInputError(f"{where}: {value!r}; expected {{count: K, tokens: P, hot_share: H}} or 'KxP' "
                              "(K system prompts of P tokens, e.g. 8x1000)")
    hot = value.get("hot_share", 0.0)
    try:
        hot = float(hot)
    except (TypeError, ValueError):
        hot = -1.0
    if not 0.0 <= hot < 1.0:
        raise BenchInputError(f"{where}.hot_share: {value.get('hot_share')!r}; expected a share in [0, 1) of the "
                              "sessions that use system prompt 0")
    return PrefixPool(_positive_int(value["count"], f"{where}.count", 10_000),
                      _positive_int(value["tokens"], f"{where}.tokens", 1_000_000), hot)


def mix_from_dict(data: dict[str, Any], source: str = "mix") -> WorkloadMix:
    if not isinstance(data, dict) or not isinstance(data.get("classes"), list) or not data["classes"]:
        raise BenchInputError(f"{source}: expected a mapping with a non-empty 'classes' list")
    unknown = set(data) - {"classes", "seed"}
    if unknown:
        raise BenchInputError(f"{source}: unknown key(s) {sorted(unknown)}; expected 'classes' and 'seed'")
    allowed = {"name", "weight", "input_tokens", "output_tokens", "api", "ignore_eos", "system_prompts", "turns",
               "sessions"}
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
            api=api, ignore_eos=bool(c.get("ignore_eos", False)),
            prefixes=parse_prefix_pool(c["system_prompts"], f"{where}.system_prompts") if c.get("system_prompts")
            else None,
            turns=_positive_int(c.get("turns", 1), f"{where}.turns", 64),
            sessions=_positive_int(c.get("sessions", 8), f"{where}.sessions", 10_000)))
    mix = WorkloadMix(tuple(classes), seed=int(data.get("seed", 0)))
    validate_mix(mix, source)
    return mix


INLINE_OPTIONS = {"prefixes": "system_prompts", "hot": "hot_share", "turns": "turns", "sessions": "sessions"}


def parse_mix_inline(text: str) -> WorkloadMix:
    """``NAME:WEIGHT:IN:OUT[:API][:OPTION=VALUE...],...`` e.g. ``short:0.6:64-512:32-256:chat,long:0.4:4096-8192:512``.

    Options: ``prefixes=KxP`` (K shared system prompts of P tokens), ``hot=H`` (share of sessions on prompt 0),
    ``turns=N`` (turns per session), ``sessions=S`` (sessions open at once), e.g.
    ``agent:1:64:32:prefixes=8x1000:turns=4``.
    """
    classes = []
    for i, item in enumerate(x for x in text.split(",") if x.strip()):
        parts = item.strip().split(":")
        options = [p for p in parts[4:] if "=" in p]
        parts = parts[:4] + [p for p in parts[4:] if "=" not in p]
        if len(parts) not in (4, 5):
            raise BenchInputError(
                f"--mix item {item!r}: expected NAME:WEIGHT:INPUT_TOKENS:OUTPUT_TOKENS[:chat|completion]"
                f"[:OPTION=VALUE...] with options {sorted(INLINE_OPTIONS)}")
        c: dict[str, Any] = {"name": parts[0], "weight": parts[1], "input_tokens": parts[2], "output_tokens": parts[3]}
        if len(parts) == 5:
            c["api"] = parts[4]
        pool: dict[str, Any] = {}
        for opt in options:
            key, _, value = opt.partition("=")
            if key not in INLINE_OPTIONS:
                raise BenchInputError(f"--mix item {item!r}: unknown option {key!r}; expected one of "
                                      f"{sorted(INLINE_OPTIONS)}")
            if key == "prefixes":
                k, _, p = value.lower().partition("x")
                pool |= {"count": k, "tokens": p}
            elif key == "hot":
                pool["hot_share"] = value
            else:
                c[INLINE_OPTIONS[key]] = value
        if pool:
            if "count" not in pool:
                raise BenchInputError(f"--mix item {item!r}: hot= needs prefixes=KxP")
            c["system_prompts"] = pool
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
        replace(c, weight=overrides.get(c.name, c.weight)) for c in mix.classes)
    new = WorkloadMix(classes, mix.seed)
    validate_mix(new, "--weight")
    return new


def check_context(mix: WorkloadMix, max_model_len: int | None) -> None:
    if not max_model_len:
        return
    for c in mix.classes:
        need = c.max_prompt_tokens + c.output_tokens.hi
        if need > max_model_len:
            what = (f"system prompt {c.prefixes.tokens if c.prefixes else 0} + {c.turns} turns of input up to "
                    f"{c.input_tokens.hi} and output up to {c.output_tokens.hi}" if c.has_sessions
                    else f"input up to {c.input_tokens.hi} + output up to {c.output_tokens.hi}")
            raise BenchInputError(
                f"class {c.name!r}: {what} = {need} tokens exceeds the model's context ({max_model_len=}); "
                "lower the ranges")



def fixed_completion_mix(input_tokens: int, output_tokens: int) -> WorkloadMix:
    """One class of completions with exactly ``output_tokens`` out (``ignore_eos``): the fixed shape benchmarks
    compare tools and engine options on."""
    mix = parse_mix_inline(f"x:1:{input_tokens}:{output_tokens}:completion")
    return dataclasses.replace(mix, classes=tuple(dataclasses.replace(c, ignore_eos=True) for c in mix.classes))
