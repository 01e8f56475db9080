"""Read ``fleet.yaml`` into a :class:`FleetConfig`, with errors that name file, line, key path and expectation.

Errors quote the values they refuse, with every secret masked (:mod:`lmfleet.config.redact`)."""

from __future__ import annotations

import difflib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lmfleet.config.fleet import FleetConfig
from lmfleet.config.redact import redact, redact_text, secret_values
from lmfleet.errors import LmfleetError

DEFAULT_FLEET = "default.yaml"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ConfigError(LmfleetError):
    """A fleet file that cannot be used. ``str()`` is the full, user-facing message."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: invalid fleet config ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


def _fmt_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            s = str(part)
            plain = s.isidentifier() or s.replace("-", "_").isidentifier()
            out += (f".{s}" if out else s) if plain else f'["{s}"]' if out else f'"{s}"'
    return out or "(top level)"


def _node_lines(text: str) -> dict[tuple[Any, ...], int]:
    """Map key paths to 1-based line numbers, from YAML's node tree."""
    lines: dict[tuple[Any, ...], int] = {}
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return lines

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value
                lines[path + (key,)] = k.start_mark.line + 1
                walk(v, path + (key,))
                lines[path + (key,)] = k.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the parent of ``loc`` (for 'did you mean')."""
    model: Any = FleetConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        cands = [ann, *getattr(ann, "__args__", ())]
        for c in list(cands):
            cands.extend(getattr(c, "__args__", ()))
        model = next((c for c in cands if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _describe(err: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        owner = _model_at(loc)
        known = sorted(owner.model_fields) if owner else []
        key = str(loc[-1])
        close = difflib.get_close_matches(key.strip(), known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown key {key!r}{hint} (allowed here: {', '.join(known)})"
    if err["type"] == "missing":
        return "required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    if isinstance(got, (dict, list)):
        return msg
    key = str(loc[-1]) if loc else ""
    if key.endswith("_env") and isinstance(got, str) and not _ENV_NAME.fullmatch(got):
        # a refused variable name is often the secret itself, pasted where its variable's name belongs
        return (f"{msg} (got a value that is not an environment variable name; not shown, as it may be the secret: "
                f"put the secret in an environment variable and name that variable here)")
    return f"{msg} (got {redact(got, key)!r})"


def parse_config(data: Any, source: str = "<config>", text: str | None = None) -> FleetConfig:
    if data is None:
        raise ConfigError(source, ["the file is empty; expected a mapping with at least `models:`"])
    if not isinstance(data, dict):
        raise ConfigError(source, [f"expected a mapping at the top level, got {type(data).__name__}"])
    try:
        return FleetConfig.model_validate(data)
    except ValidationError as e:
        lines = _node_lines(text) if text else {}
        secrets = secret_values(data)
        problems = []
        for err in e.errors():
            loc = tuple(err["loc"])
            line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
            where = f"line {line}: " if line else ""
            problems.append(redact_text(f"{where}{_fmt_path(loc)}: {_describe(err)}", secrets))
        raise ConfigError(source, problems) from None


def load_config(path: str | os.PathLike[str] | None = None) -> FleetConfig:
    """Load a fleet file, or the embedded default when ``path`` is None."""
    if path is None:
        text = resources.files("lmfleet.config").joinpath(DEFAULT_FLEET).read_text()
        source = f"<embedded {DEFAULT_FLEET}>"
    else:
        p = Path(path)
        source = str(p)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError(source, ["file not found"]) from None
        except OSError as e:
            raise ConfigError(source, [f"cannot read: {e.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, [f"{where}not valid YAML: {getattr(e, 'problem', e)}"]) from None
    return parse_config(data, source, text)


def default_config_text() -> str:
    return resources.files("lmfleet.config").joinpath(DEFAULT_FLEET).read_text()
