"""Tokenizer checks: the tokenizer that ships with (or is configured for) a model must match it.

An old or foreign tokenizer loads fine and serves garbage: text in the wrong language, answers that
never stop. Each check below works on an already loaded tokenizer, so tests can hand in broken ones.
"""

from __future__ import annotations

from typing import Any

from lmfleet.check.result import CheckResult, failed, passed, skipped, warned
from lmfleet.config.models import FleetConfig, ModelConfig
from lmfleet.models.tokenizer import TokenizerLoadError, load_tokenizer

ROUNDTRIP_TEXTS: dict[str, str] = {
    "vietnamese": "Xin chào thế giới! Tiếng Việt có dấu: ắ ặ ổ ữ đ Đ.",
    "chinese": "你好，世界。大型语言模型在集群上运行。",
    "emoji": "Emoji 🙂👍🏽🇻🇳 👨‍👩‍👧 done.",
    "code": "def f(x):\n\treturn {'a': x ** 2}  # ok\n",
}
_MARK = "LMFLEET_ANSWER_MARK"


def check_roundtrip(tok: Any, subj: str, texts: dict[str, str] = ROUNDTRIP_TEXTS) -> CheckResult:
    bad = []
    for label, text in texts.items():
        try:
            got = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is the finding
            bad.append(f"{label}: {type(e).__name__}: {e}")
            continue
        if got != text:
            bad.append(f"{label}: {text!r} came back as {got!r}")
    if bad:
        return failed("tokenizer.roundtrip", subj, "text does not survive encode/decode: " + "; ".join(bad),
                      "use the tokenizer that belongs to this checkpoint (byte-fallback/byte-level BPE), "
                      "not an old or foreign one", failures=bad)
    return passed("tokenizer.roundtrip", subj, f"{', '.join(texts)} round-trip exactly")


def _special_ids(tok: Any) -> set[int]:
    ids = set(getattr(tok, "all_special_ids", []) or [])
    for tid, added in (getattr(tok, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(tid))
    return ids


def end_of_turn_id(tok: Any) -> int | None:
    """The special token the chat template puts after an assistant message (None: none found)."""
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}],
                                   tokenize=False)
    if _MARK not in text:
        return None
    tail = text.split(_MARK, 1)[1]
    special = _special_ids(tok)
    return next((i for i in tok.encode(tail, add_special_tokens=False) if i in special), None)


def check_chat_template(tok: Any, subj: str) -> tuple[CheckResult, int | None]:
    if not getattr(tok, "chat_template", None):
        return failed("tokenizer.chat_template", subj,
                      "no chat template: /v1/chat/completions fails (transformers no longer guesses one)",
                      "use an instruct checkpoint, or add chat_template.jinja / tokenizer_config.json's chat_template"), None
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "Ping 你好"}], tokenize=False,
                                       add_generation_prompt=True)
        eot = end_of_turn_id(tok)
    except Exception as e:  # noqa: BLE001 - jinja errors of every kind
        return failed("tokenizer.chat_template", subj, f"the chat template does not render: {type(e).__name__}: {e}",
                      "fix or replace the chat template"), None
    if "Ping 你好" not in text:
        return failed("tokenizer.chat_template", subj, f"the rendered prompt lost the user message: {text[:120]!r}",
                      "fix the chat template"), eot
    return passed("tokenizer.chat_template", subj, f"renders: {text[:80]!r}"), eot


def _ids(v: Any) -> set[int]:
    if isinstance(v, int):
        return {v}
    if isinstance(v, (list, tuple)):
        return {int(x) for x in v if isinstance(x, int)}
    return set()


def check_stop_tokens(tok: Any, subj: str, *, model_config: dict[str, Any] | None,
                      generation_config: dict[str, Any] | None, end_of_turn: int | None) -> CheckResult:
    tok_eos = tok.eos_token_id
    gen_eos = _ids((generation_config or {}).get("eos_token_id"))
    cfg_eos = _ids((model_config or {}).get("eos_token_id"))
    stops = ({tok_eos} if tok_eos is not None else set()) | gen_eos
    problems = []
    if tok_eos is None and not gen_eos:
        problems.append("neither the tokenizer nor generation_config.json names an EOS token")
    if gen_eos and tok_eos is not None and tok_eos not in gen_eos and not (cfg_eos & {tok_eos}):
        problems.append(f"tokenizer eos_token_id={tok_eos} ({tok.eos_token!r}) is not in generation_config "
                        f"eos_token_id={sorted(gen_eos)}")
    if end_of_turn is not None and end_of_turn not in stops | cfg_eos:
        problems.append(f"the chat template ends a turn with {tok.convert_ids_to_tokens(end_of_turn)!r} (id {end_of_turn}), "
                        f"which is no stop token {sorted(stops)}: answers run on to max_tokens")
    bos = (model_config or {}).get("bos_token_id")
    if isinstance(bos, int) and tok.bos_token_id is not None and tok.bos_token_id != bos:
        problems.append(f"tokenizer bos_token_id={tok.bos_token_id} but config.json bos_token_id={bos} (an older tokenizer?)")
    if problems:
        return warned("tokenizer.stop_tokens", subj, "; ".join(problems),
                      "make generation_config.json eos_token_id list every end-of-turn token, and use the "
                      "checkpoint's own tokenizer", stops=sorted(stops))
    return passed("tokenizer.stop_tokens", subj, f"stop tokens {sorted(stops)} include the end of turn"
                  + (f" ({tok.convert_ids_to_tokens(end_of_turn)})" if end_of_turn is not None else ""))


def check_vocab(tok: Any, subj: str, vocab_size: int | None) -> CheckResult:
    if vocab_size is None:
        return skipped("tokenizer.vocab", subj, "config.json has no vocab_size")
    n = len(tok)
    top = max(_special_ids(tok) | {n - 1})
    if top >= vocab_size:
        return failed("tokenizer.vocab", subj,
                      f"the tokenizer has ids up to {top} but the embedding has {vocab_size} rows: those ids index past "
                      f"the weights (crash or garbage)",
                      "use the tokenizer of this checkpoint (a newer tokenizer added tokens the model never learned)")
    return passed("tokenizer.vocab", subj, f"{n} tokens fit {vocab_size} embedding rows")


def check_matches_checkpoint(tok: Any, reference: Any, subj: str, location: str, reference_location: str) -> CheckResult:
    """A separately configured tokenizer must encode like the checkpoint's own one (same ids for the same text)."""
    diffs = []
    for label, text in ROUNDTRIP_TEXTS.items():
        a, b = tok.encode(text, add_special_tokens=False), reference.encode(text, add_special_tokens=False)
        if a != b:
            diffs.append(f"{label}: {a[:6]}... vs {b[:6]}...")
    if diffs:
        return failed("tokenizer.matches_checkpoint", subj,
                      f"tokenizer {location} encodes text differently from the checkpoint's own tokenizer "
                      f"({reference_location}): the model reads other tokens than it was trained on ({'; '.join(diffs)})",
                      "drop the `tokenizer:` key, or point it at the tokenizer of this exact checkpoint")
    return passed("tokenizer.matches_checkpoint", subj, f"{location} encodes like the checkpoint's own tokenizer")


def check_overflow_mapping(m: ModelConfig, cfg: FleetConfig) -> list[CheckResult]:
    out = []
    for p in cfg.providers:
        if m.name in p.model_map:
            out.append(warned("tokenizer.overflow", m.name,
                              f"overflow maps {m.name} -> {p.name}:{p.model_map[m.name]}; that provider's tokenizer and "
                              f"chat template cannot be verified from here (answers may differ in format and length)",
                              "check the provider serves the same checkpoint/template, or accept the difference",
                              provider=p.name, remote_model=p.model_map[m.name]))
    return out


def check_tokenizer(m: ModelConfig, cfg: FleetConfig, location: str | None, *, model_config: dict[str, Any] | None,
                    generation_config: dict[str, Any] | None, reference_location: str | None = None) -> list[CheckResult]:
    """All tokenizer checks for one model; ``location`` is a folder (None: nothing available offline).

    ``reference_location``: the checkpoint's own tokenizer folder when ``tokenizer:`` points elsewhere.
    """
    out = check_overflow_mapping(m, cfg)
    if location is None:
        return [skipped("tokenizer.load", m.name, f"no local tokenizer for {m.tokenizer or m.source} (hub id, offline); "
                                                  f"it is checked when the files are on this machine"), *out]
    try:
        tok = load_tokenizer(location, trust_remote_code=m.engine.trust_remote_code)
    except TokenizerLoadError as e:
        return [failed("tokenizer.load", m.name, str(e),
                       "point `tokenizer:` (or `source:`) at a folder with tokenizer.json/tokenizer_config.json"), *out]
    results = [passed("tokenizer.load", m.name, f"{type(tok).__name__} from {location} ({len(tok)} tokens)")]
    results.append(check_roundtrip(tok, m.name))
    tmpl, eot = check_chat_template(tok, m.name)
    results.append(tmpl)
    results.append(check_stop_tokens(tok, m.name, model_config=model_config, generation_config=generation_config,
                                     end_of_turn=eot))
    results.append(check_vocab(tok, m.name, (model_config or {}).get("vocab_size")))
    if reference_location and reference_location != location:
        try:
            reference = load_tokenizer(reference_location, trust_remote_code=m.engine.trust_remote_code)
        except TokenizerLoadError:  # the checkpoint's own files may be partial; nothing to compare
            reference = None
        if reference is not None:
            results.append(check_matches_checkpoint(tok, reference, m.name, location, reference_location))
    return results + out
