"""One reader for typed TOML settings: dataclasses in, dataclasses out.

Used by the training config, hardware profiles and simulator settings alike. A
dataclass describes the keys (names, types, defaults); this module fills it from a
TOML table or from `--section.key=value` overrides, coerces each value to the
field's type, and writes it back as TOML. Every mistake is a ConfigError naming the
key (with `where`, the file or section it came from) and what would be valid.

Field types understood: bool, int, float, str, `X | None`, `list[X]`, `dict[str, X]`
(a table; given keys replace those of the current value), and nested dataclasses
(a sub-table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from shardline.errors import ConfigError, did_you_mean


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file as a dict; a missing, unreadable or malformed file is a ConfigError naming it (as `what`)."""
    if not str(path).strip():  # ("" is the working directory: "a folder", which it was not given as)
        raise ConfigError(f"{what} path is empty: give a .toml file")
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))  # (a byte-order mark some editors write)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a folder; give a .toml file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid TOML: {' '.join(str(e).split())}") from None


def parse_scalar(text: str) -> Any:
    """An override's value: TOML when it parses (3, 1e-4, true, [1, 2]), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare words such as bf16 or runs/x are strings


def split_override(item: str, raw: bool = False) -> tuple[str, str, Any]:
    """`--section.key=value` -> (section, key, value); raw: the value's text, unparsed."""
    item = item.removeprefix("--")
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like --section.key=value")
    dotted, text = item.split("=", 1)
    section, key = dotted.split(".", 1)
    return section, key, text if raw else parse_scalar(text)


def field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def updated(obj: Any, raw: dict[str, Any], where: str, kind: str = "config key") -> Any:
    """A copy of dataclass `obj` with the keys of `raw` set (typed); `where` prefixes key names.

    Works for frozen dataclasses too. Unknown keys are errors listing the valid ones.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table of keys, got {raw!r}")
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    changes = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"unknown {kind} {where}.{key}{did_you_mean(key, fields, f'{where}.')}; valid keys: "
                              f"{', '.join(fields)}")
        if fields[key].metadata.get("switch") and isinstance(value, bool):
            value = int(value)  # a -1/0/1 switch (-1: keep the preset's) takes true and false as 1 and 0
        try:
            changes[key] = coerce(f"{where}.{key}", _plain(value), hints[key], getattr(obj, key))  # (from_dict's Path)
        except ConfigError as e:  # a field may say what its values mean (a -1/0/1 switch is no bool)
            valid = fields[key].metadata.get("valid")
            raise ConfigError(f"{e}; valid: {valid}" if valid else str(e)) from None
    return dataclasses.replace(obj, **changes)


def check_types(obj: Any, where: str) -> None:
    """Every field of dataclass `obj` of its declared type, and no attribute that is not a field: what
    reading a file guarantees, for values set in code too (where the string "false" would read as
    true, and 4.5 steps would train 5). Each value is put back as the reader would have made it (a
    numpy number as a Python one, a tuple as a list), so the config saved with a run reads back.
    `where` names the section in the one-line error."""
    hints, names = typing.get_type_hints(type(obj)), field_names(obj)
    extra = [k for k in vars(obj) if k not in names and not k.startswith("_")]
    if extra:
        raise ConfigError(f"unknown config key {where}.{extra[0]}{did_you_mean(extra[0], names, f'{where}.')}; "
                          f"valid keys: {', '.join(names)}")
    for f in dataclasses.fields(obj):
        value, key, hint = getattr(obj, f.name), f"{where}.{f.name}", hints[f.name]
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(value):
            check_types(value, key)
        elif dataclasses.is_dataclass(item) and isinstance(value, list):  # a list of tables: data.mix
            for i, v in enumerate(value):
                if not isinstance(v, item):  # (set in code: a dict is a file's table, not the object code makes)
                    raise ConfigError(f"{key}[{i}]={v!r} has the wrong type: expected {_kind(item, one=True)} "
                                      f"(in code: {item.__name__}(...), from shardline.config)")
                check_types(v, f"{key}[{i}]")
        elif not (f.metadata.get("switch") and isinstance(value, bool)):  # (a switch takes true/false)
            plain = _plain(value)
            read = coerce(key, plain, hint, value)
            if isinstance(plain, str) and not isinstance(read, str):  # "1.5": a number on a command line only
                raise ConfigError(f"{key}={value!r} has the wrong type: expected {type(read).__name__}")
            setattr(obj, f.name, read)


def _plain(value: Any) -> Any:
    """A value set in code as a file would give it: numpy's scalars (numbers, bool_) as Python's, a
    tuple or a list of them as a list, a pathlib.Path as its string."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # (np.generic: np.int64, np.bool_, ...)
        return value.item()
    return value


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def coerce(key: str, value: Any, hint: Any, current: Any = None) -> Any:
    """`value` as type `hint`, or a ConfigError `key=value has the wrong type`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:  # e.g. int | None
        args = [h for h in typing.get_args(hint) if h is not type(None)]
        exact = [h for h in args if isinstance(h, type) and type(value) is h]
        if exact:  # a value of one member's own type stays that type (5 in int | str is 5)
            return coerce(key, value, exact[0], current)
        for h in args[:-1]:
            try:
                return coerce(key, value, h)
            except ConfigError:
                pass
        hint = args[-1]
    if dataclasses.is_dataclass(hint):
        return updated(current if current is not None else hint(), value, key)
    origin = typing.get_origin(hint)
    if origin is list:
        item = typing.get_args(hint)[0]
        if isinstance(value, list):
            return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        if isinstance(value, str) and value.lstrip().startswith("[") and dataclasses.is_dataclass(item):
            example = ", ".join(f"{f.name} = ..." for f in dataclasses.fields(item))
            raise ConfigError(f"{key}={value!r} is not TOML: write a list of inline tables, [{{{example}}}, ...] "
                              "(TOML's key = \"value\", not JSON's \"key\": \"value\")")
        raise ConfigError(f"{key}={value!r} has the wrong type: expected a list of {_kind(item)}")
    if origin is dict:
        item = typing.get_args(hint)[1]
        if isinstance(value, dict):
            given = {str(k): coerce(f"{key}.{k}", v, item) for k, v in value.items()}
            return {**(current or {}), **given}
        raise ConfigError(f"{key}={value!r} has the wrong type: expected a table of {item.__name__}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(key, value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # a file's: --key=2024.10 stays text
            raise ConfigError(f"{key}={value!r} has the wrong type: expected a quoted string (TOML reads the "
                              f"unquoted {value!r} as a number, which would name another thing: write \"...\")")
    elif hint is Any:
        return value
    if hint is float and isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        return _finite(key, value)  # --optim.lr=.001 or 5. is not TOML, but is plainly a number
    expected = "true or false" if hint is bool else getattr(hint, "__name__", hint)
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {expected}")



def _finite(key: str, value: Any) -> float:
    """`value` as a float, or the one line for one that is not finite (1e999 too, and an integer
    too large for a float)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{key}={value!r} is not a finite number")
    return number


def to_toml(obj: Any, comment: str = "", remarks: dict[str, str] | None = None) -> str:
    """A dataclass (or a dict) as TOML: scalars first, then one table per nested dataclass or dict.
    `remarks`: a comment at the end of a key's line, by "table.key" (a value a reader would misread)."""
    values = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else dict(obj)
    remarks = remarks or {}

    def entry(key: str, v: Any, table: str = "") -> str:
        remark = remarks.get(f"{table}.{key}" if table else key)
        return f"{key} = {toml_value(v)}" + (f"  # {remark}" if remark else "")

    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [entry(k, v) for k, v in values.items() if v is not None and not isinstance(v, dict)]
    for name, table in values.items():
        if isinstance(table, dict):
            if lines:
                lines.append("")
            lines.append(f"[{name}]")
            lines += [entry(k, v, name) for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def toml_value(v: Any) -> str:
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):  # JSON's escapes are TOML's (control characters as \uXXXX), but for DEL
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


class OnlyOnce(argparse.Action):
    """A command-line option given at most once: a second --config would replace the first
    whole, not merge into it, which nobody typing two files means."""

    def __call__(self, parser, namespace, values, option_string=None):
        earlier = getattr(namespace, self.dest)
        if earlier is not None:
            parser.error(f"{option_string} given twice ({earlier}, {values}): give one file and override its "
                         "keys with --section.key=value")
        setattr(namespace, self.dest, values)


def _kind(item, one: bool = False) -> str:
    """What a list's items are (`one`: what one item is), in a config's words: a table and its keys
    for a section-like dataclass (data.mix's {path, weight, format, text_field}), else the type's name."""
    if dataclasses.is_dataclass(item):
        return ("a table {" if one else "tables {") + ", ".join(f.name for f in dataclasses.fields(item)) + "}"
    return getattr(item, "__name__", str(item))


def key_of(error: ConfigError) -> str:
    """The section.key a config error's line opens with ("train.steps='lots' ..."), else ""."""
    words = str(error).split("=", 1)[0].split() if "=" in str(error) else []
    head = words[0] if words else ""
    return head if head.count(".") == 1 and head.replace(".", "").replace("_", "").isalnum() else ""


def whole_config(raw: dict) -> bool:
    """Whether a saved config, as read, holds its [model] table: every save writes each section, so a
    file without it was emptied or cut short (a crash before its data reached the disk), not a config."""
    return isinstance(raw.get("model"), dict)
