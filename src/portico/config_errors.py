"""Settings errors an operator can act on: where the bad value came from, what is valid.

msgspec reports a failed conversion as text ending in a path (``- at `$.agents[...].runtime```)
and hides dict keys behind ``[...]``. `explain` walks that path through the merged
data and the declared types together, fills in the hidden keys, and says which
source set the value (config file and key, ``PORTICO_*`` variable or flag), the
valid values of an enum, and the nearest name for an unknown key. It knows nothing
of the settings classes: it reads them from the types it is given, so settings
added later are explained the same way.
"""

from __future__ import annotations

import difflib
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
import yaml

from portico.errors import ConfigError

_PATH = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_SEGMENT = re.compile(r"\.(\w+)|\[(\d+)\]|\[(\.\.\.)\]")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_EXPECTED = re.compile(r"^Expected (?P<what>.+?)(?:, got `[^`]+`)?$")
_MISSING = object()
_SHOWN_CHARS = 60


@dataclass(frozen=True)
class Origin:
    """Where a top-level setting's value came from."""

    kind: Literal["file", "env", "flag"]
    name: str  # the file's path, the variable's or the flag's name

    def at(self, keys: list[str | int]) -> str:
        """The source of the value at `keys`: a variable or flag names the top-level
        setting itself, so a key is added only for a value inside it."""
        if self.kind == "file":
            return f"config file {self.name}" + (f", key {dotted(keys)}" if keys else "")
        return self.name + (f", key {dotted(keys)}" if len(keys) > 1 else "")


def dotted(keys: list[str | int]) -> str:
    text = ""
    for key in keys:
        if isinstance(key, int):
            text += f"[{key}]"
        elif key.isidentifier():
            text += f".{key}" if text else key
        else:
            text += f"[{key!r}]"
    return text


def nearest(name: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: list[str]) -> str:
    match = nearest(name, candidates)
    return f" (did you mean {match!r}?)" if match else ""


def explain(
    error: msgspec.ValidationError,
    data: dict[str, Any],
    root: type,
    origins: dict[str, Origin],
    *,
    secret: frozenset[str] = frozenset(),
) -> str:
    """One line: the source of the bad value, what is wrong, what would be right.
    Values of the `secret` top-level settings are never repeated."""
    parsed = _PATH.match(str(error))
    assert parsed is not None  # the pattern matches any text
    detail, path = parsed["detail"], parsed["path"] or ""
    keys, value, kind = _locate(data, root, path)
    unknown = _UNKNOWN.match(detail)
    if unknown:
        name = unknown["name"]
        origin = origins.get(str(keys[0]) if keys else name)
        where = origin.at(keys) if origin else "settings"
        return f"{where}: unknown setting {name!r}{did_you_mean(name, _field_names(kind))}"
    origin = origins.get(str(keys[0])) if keys else None
    where = origin.at(keys) if origin else dotted(keys) or "settings"
    shown = "" if keys and keys[0] in secret else _shown(value)
    choices = _choices(kind)
    if choices is not None:
        valid = ", ".join(str(choice) for choice in choices)
        return f"{where}: invalid value{shown}; valid values: {valid}"
    expected = _EXPECTED.match(detail)
    if expected:
        return f"{where}: invalid value{shown}; expected {expected['what']}"
    return f"{where}: {detail[:1].lower()}{detail[1:]}"


def _shown(value: Any) -> str:
    if value is _MISSING or not isinstance(value, str | int | float | bool | None):
        return ""
    text = repr(value)
    return " " + (text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "...")


# -- walking data and types together ---------------------------------------------------


@dataclass(frozen=True)
class _Tags:
    """A tagged union of structs whose tag value is missing or unknown."""

    field: str
    tags: tuple[str, ...]


def _locate(data: Any, root: Any, path: str) -> tuple[list[str | int], Any, Any]:
    """msgspec's `path` with the hidden dict keys filled in, the value there and its type."""
    keys: list[str | int] = []
    value, kind = data, root
    for name, index, hidden in _SEGMENT.findall(path):
        if name:
            kind = _field_type(kind, value, name)
            value = value.get(name, _MISSING) if isinstance(value, dict) else _MISSING
            keys.append(name)
        elif index:
            kind = _argument(kind, value, 0)
            position = int(index)
            in_range = isinstance(value, list | tuple) and position < len(value)
            value = value[position] if in_range else _MISSING
            keys.append(position)
        elif hidden:
            kind = _argument(kind, value, 1)
            key = _failing_key(value, kind)
            if key is None:
                return keys, _MISSING, None
            value = value[key]
            keys.append(key)
    return keys, value, _resolved(kind, value)


def _failing_key(value: Any, kind: Any) -> str | None:
    """The first entry of the mapping `value` that does not convert to `kind`."""
    if not isinstance(value, dict) or kind is None:
        return None
    for key, item in value.items():
        try:
            msgspec.convert(item, kind, strict=False)
        except msgspec.ValidationError:
            return str(key)
    return None


def _resolved(kind: Any, value: Any) -> Any:
    """`kind` without `Annotated`, `None` options and the union members `value` is not."""
    while True:
        origin = get_origin(kind)
        if origin is Annotated:
            kind = get_args(kind)[0]
        elif origin is Union or origin is types.UnionType:
            options = [option for option in get_args(kind) if option is not type(None)]
            if len(options) == 1:
                kind = options[0]
            else:
                return _tagged_member(options, value)
        else:
            return kind


def _tagged_member(options: list[Any], value: Any) -> Any:
    configs = [getattr(option, "__struct_config__", None) for option in options]
    tags: dict[str, Any] = {}
    for option, config in zip(options, configs, strict=True):
        if config is None or config.tag_field is None:
            return None
        tags[str(config.tag)] = option
    field = configs[0].tag_field if configs[0] is not None else ""
    tag = value.get(field) if isinstance(value, dict) else None
    return tags.get(str(tag)) or _Tags(field, tuple(sorted(tags)))


def _field_type(kind: Any, value: Any, name: str) -> Any:
    kind = _resolved(kind, value)
    if isinstance(kind, _Tags):
        return kind if name == kind.field else None
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        for field in msgspec.structs.fields(kind):
            if field.encode_name == name:
                return field.type
    return None


def _argument(kind: Any, value: Any, position: int) -> Any:
    """The item type of a sequence (0) or the value type of a mapping (1)."""
    args = get_args(_resolved(kind, value))
    if not args:
        return None
    return args[min(position, len(args) - 1)]


def _choices(kind: Any) -> tuple[Any, ...] | None:
    if isinstance(kind, _Tags):
        return kind.tags
    if get_origin(kind) is Literal:
        return get_args(kind)
    return None


def _field_names(kind: Any) -> list[str]:
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return [field.encode_name for field in msgspec.structs.fields(kind)]
    return []


# -- files --------------------------------------------------------------------------------


def read_yaml(path: str | Path, what: str, error: type[ConfigError] = ConfigError) -> Any:
    """The YAML (or JSON) document in `path`; a failure is one line naming `what` and the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path}: not UTF-8 text") from exc
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {(exc.strerror or str(exc)).lower()}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise error(f"{what} {path}: invalid YAML{at}: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise error(f"{what} {path}: invalid YAML: {' '.join(str(exc).split())}") from exc
