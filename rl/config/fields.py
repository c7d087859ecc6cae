"""Schema fields and building a config from a mapping: `opt` and `section` declare fields, `build` turns
a (nested) mapping into the dataclass, validating every key and value.

Every trainer has one dataclass schema whose fields carry a one-line help text (`opt(default,
"help")`; `REQUIRED` for no default); nested sections (`section(LoraSection, ...)`) are filled from a
YAML mapping or from dotted keys. `build` converts each value to the field's type (`_convert`: YAML
and command-line strings alike, so `"3"` is an int where an int is expected and `yes`/`off` a bool,
`TRUE_WORDS` / `FALSE_WORDS`) and raises one `ConfigError` line naming the key, the value and what was
expected (`type_name`). An unknown key suggests the closest known one, our own keys before aliases:
most of what goes wrong with recipes is a typo.

Other names of a key (the reference docs' and TRL's, our former ones) are rl.config.vocabulary's one
table: `build` brings a mapping to the schema's own names first (`canonical`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from rl.config.vocabulary import FALSE_WORDS, TRUE_WORDS, aliases_of, canonical
from rl.errors import ConfigError

REQUIRED = dataclasses.MISSING


def opt(default: Any = REQUIRED, help: str = "", **kw) -> Any:
    """A schema field with a default (`REQUIRED` for none) and a one-line help text."""
    meta = {"help": help}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


def section(cls: type, help: str = "") -> Any:
    """A nested config section (itself a dataclass), filled from a YAML mapping or dotted keys."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def one_of_list(value: Any, key: str, why: str) -> Any:
    """TRL's list form of a key that takes one value here (DPO's loss_type: [sigmoid]): the one item; a longer
    list is one ConfigError line saying `why`."""
    if not isinstance(value, (list, tuple)):
        return value
    if len(value) != 1:
        raise ConfigError(f"key '{key}' has {len(value)} values {list(value)}: {why}; give one")
    return value[0]


# --------------------------------------------------------------------------------------------------
# Type conversion
# --------------------------------------------------------------------------------------------------

def type_name(tp: Any) -> str:
    """How a type reads in a message or in --help: `int or null`, `list[str]`, `'a' | 'b'`."""
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _load_inline(text: str) -> Any:
    """An inline YAML/JSON value from the command line or a recipe string; a syntax error becomes a
    TypeError that says what was expected (build() names the key)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TypeError(f"valid inline YAML/JSON such as {{a: 1}} or [1, 2] ({problem}; quote the "
                        f"whole value in the shell)") from None


def _convert(value: Any, tp: Any) -> Any:
    """Convert a YAML/CLI value to `tp`, raising TypeError(expected-type) when it cannot."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a)
            except (TypeError, ValueError) as e:
                errors.append(e.args[0] if isinstance(e, TypeError) and e.args else type_name(a))
        if len(errors) == 1 and type(None) in args:  # `X | None`: say what was wrong with X
            raise TypeError(f"{errors[0]}, or null")
        raise TypeError(type_name(tp))
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        raise TypeError(type_name(tp))
    if origin in (list, tuple):
        if value is None:  # a list key given null (`reward_funcs:` with nothing): none
            return []
        if isinstance(value, str):
            parsed = _load_inline(value) if value.strip().startswith("[") else value.split(",")
            value = parsed if isinstance(parsed, list) else [parsed]
        if not isinstance(value, (list, tuple)):
            raise TypeError(type_name(tp))
        (inner, *_) = get_args(tp) or (Any,)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_convert(v, inner))
            except (TypeError, ValueError):
                raise TypeError(f"a list of {type_name(inner)}, but item {i} is {v!r}") from None
        return out
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = _load_inline(value)
        if not isinstance(value, dict):
            raise TypeError(f"{type_name(tp)} (a mapping such as {{a: 1, b: 2}})")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        out = {}
        for k, v in value.items():
            try:
                out[_convert(k, key_tp)] = _convert(v, val_tp)
            except (TypeError, ValueError):
                raise TypeError(f"{type_name(val_tp)} for every value, but {k!r} is {v!r}") from None
        return out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:
            return value.lower() in TRUE_WORDS
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise TypeError("bool (true or false)")
    if tp is int:
        if isinstance(value, bool):
            raise TypeError("int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                f = float(value)  # accepts "1e3"
                if f.is_integer():
                    return int(f)
        raise TypeError("int")
    if tp is float:
        if isinstance(value, bool):
            raise TypeError("float")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError("float")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError("str")
    return value


# --------------------------------------------------------------------------------------------------
# Building a schema from a nested mapping
# --------------------------------------------------------------------------------------------------

def fields_of(cls: type) -> dict[str, dataclasses.Field]:
    """The schema's settable fields by name (`init` fields only)."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def hints_of(cls: type) -> dict[str, Any]:
    """The schema's field types, string annotations resolved (`typing.get_type_hints`)."""
    return typing.get_type_hints(cls)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of `cls`."""
    keys = [prefix + name for name in fields_of(cls)]
    hints = hints_of(cls)
    for name in fields_of(cls):
        if dataclasses.is_dataclass(hints[name]):
            keys += _all_keys(hints[name], f"{prefix}{name}.")
    return keys


def _words(name: str) -> set[str]:
    return {w for w in name.replace(".", "_").split("_") if w}


def suggestions(key: str, cls: type) -> list[str]:
    """The names closest to an unknown `key`: our own keys first, then the other names of the one alias table
    (the reference's and TRL's, shown with the key they are here: `lora_r (lora.rank)`). Only candidates about as
    close as the best, and sharing a word with `key` unless very close (`adam_beta1` is not `dpo_beta`)."""
    aliases = {prefix_alias: key_ for prefix_alias, key_ in _alias_keys(cls)}
    for pool in (_all_keys(cls), list(aliases)):
        close = difflib.get_close_matches(key, pool, n=4, cutoff=0.6)
        ratio = {c: difflib.SequenceMatcher(None, key, c).ratio() for c in close}
        close = [c for c in close if ratio[c] >= max(ratio.values()) - 0.1 and (ratio[c] >= 0.85 or _words(c) &
                                                                                _words(key))]
        if close:
            return [f"{c} ({aliases[c]})" if c in aliases and aliases[c] != c else c for c in close]
    return []


def _alias_keys(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(alias as typed, its key) of `cls` and its sections, with their prefixes."""
    out = [(prefix + a, prefix + k) for a, k in aliases_of(cls).items()]
    hints = hints_of(cls)
    for name in fields_of(cls):
        if dataclasses.is_dataclass(hints[name]):
            out += _alias_keys(hints[name], f"{prefix}{name}.")
    return out


def _unknown(key: str, cls: type, where: str) -> ConfigError:
    close = suggestions(key, cls)
    hint = f" (did you mean {', '.join(close)}?)" if close else " (run with --help to list the keys)"
    return ConfigError(f"{where}: unknown key '{key}'{hint}")


def build(cls: type, data: dict, where: str = "config", prefix: str = "", root: type | None = None,
          require: bool = True, typed: dict[str, str] | None = None):
    """Instantiate dataclass `cls` from a (possibly nested) mapping, validating every key.

    With `require=False` only the keys and types are checked (a recipe may leave a required key to
    the command line) and None is returned. Messages name a key as it was typed (`typed`: key, dotted below
    `cls` for a section's -> the name given, for a mapping already brought to the schema's names)."""
    root = root or cls
    fields, hints = fields_of(cls), hints_of(cls)
    typed = dict(typed or {})
    data = canonical(data, cls, where, prefix, typed)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        shown = typed.get(key, prefix + key)
        if key not in fields:
            raise _unknown(prefix + key, root, where)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: key '{shown}' is a section; give it a mapping "
                                  f"of keys, e.g. {shown}.<key>=<value>")
            inner = {k[len(key) + 1:]: v for k, v in typed.items() if k.startswith(key + ".")}
            kwargs[key] = build(tp, value, where, f"{prefix}{key}.", root, require, inner)
            continue
        try:
            kwargs[key] = _convert(value, tp)
        except (TypeError, ValueError) as e:
            expected = e.args[0] if isinstance(e, TypeError) and e.args else type_name(tp)
            raise ConfigError(f"{where}: key '{shown}' has value {value!r}, "
                              f"expected {expected}") from None
    if not require:
        return None
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is REQUIRED
               and f.default_factory is REQUIRED]
    if missing:
        name = prefix + missing[0]
        raise ConfigError(f"missing required key '{name}': set it in the recipe or pass --{name} VALUE")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        message = str(e)
        for key, shown in typed.items():  # name the key as it was typed, and what it is here
            if shown != prefix + key:
                message = message.replace(f"'{prefix}{key}'", f"'{shown}' ({prefix}{key})")
        raise ConfigError(f"{where}: {message}") from None
