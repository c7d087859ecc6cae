"""A tiny name -> function registry, one table per kind of algorithm piece.

Kinds used in rl.algos: "advantage_estimator", "policy_loss", "kl_estimator", "preference_loss".
A new variant is one decorated function:

    @register("advantage_estimator", "my_estimator")
    def my_advantages(rewards, num_generations): ...

and `get("advantage_estimator", "my_estimator")` finds it (a config names it by that string). A config
may also name a function of the user's own module as `"my_pkg.my_module:my_function"` (imported with
importlib, never evaluated); `get` imports it (once), so a user's loss needs no edit of this package; it
is not added to the table, so `names()` and the --help choices stay the package's own. `register(kind, name, **flags)` attaches flags that a trainer reads with `flag()`
(e.g. a preference loss's `needs_reference`, a policy loss's default `normalization`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
from typing import Any, Callable

from rl.errors import ConfigError

_TABLES: dict[str, dict[str, Callable]] = {}
_FLAGS: dict[tuple[str, str], dict[str, Any]] = {}


def register(kind: str, name: str, **flags: Any) -> Callable[[Callable], Callable]:
    """Decorator: file `fn` under `kind`/`name` (with `flags`); a name registered twice is a programming error."""

    def deco(fn: Callable) -> Callable:
        table = _TABLES.setdefault(kind, {})
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__qualname__})")
        table[name] = fn
        _FLAGS[(kind, name)] = flags
        return fn

    return deco


def is_dotted(name: str) -> bool:
    """`name` names a function of a module, `package.module:function`."""
    return isinstance(name, str) and name.count(":") == 1 and all(name.split(":"))


def import_function(spec: str, what: str) -> Callable:
    """The function a `package.module:function` string names, imported with importlib (no code string is
    ever evaluated); `what` names it in the one-line ValueError ("reward", "environment", a registry kind)."""
    if not is_dotted(spec):
        raise ValueError(f"a {what} given by path must look like 'package.module:function', got {spec!r}")
    module_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {what} module {module_name!r} ({e}); put it on PYTHONPATH or in the "
                         f"working directory") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"module {module_name!r} has no callable {fn_name!r} ({what} {spec!r})")
    return fn


@functools.lru_cache(maxsize=None)
def _import(kind: str, name: str) -> Callable:
    return import_function(name, kind)


def get(kind: str, name: str) -> Callable:
    """The function registered as `kind`/`name`, or the user's `module:function` (imported on first use);
    a one-line ValueError listing the valid names otherwise."""
    table = _TABLES.get(kind)
    if table is None:
        raise ValueError(f"unknown registry kind {kind!r}; kinds: {', '.join(sorted(_TABLES))}")
    if name not in table and is_dotted(name):
        return _import(kind, name)
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(table)} (or give "
                         f"'package.module:function')")
    return table[name]


def flag(kind: str, name: str, key: str, default: Any = None) -> Any:
    """A flag registered with `kind`/`name` (`default` for a user's function registered without it)."""
    get(kind, name)
    return _FLAGS.get((kind, name), {}).get(key, default)


def check(kind: str, name: str, key: str) -> None:
    """Config-time check of a key naming a `kind`: a registered name, or an importable `module:function`;
    raises ConfigError naming the key as the user wrote it (not the registry's kind), the closest name and the
    choices (exit 2 in the launch scripts)."""
    try:
        get(kind, name)
    except ValueError as e:
        table = _TABLES.get(kind, {})
        if name in table or is_dotted(name):  # an import failed: the registry's line says what
            raise ConfigError(f"key '{key}': {e}") from None
        ratio = {n: difflib.SequenceMatcher(None, str(name), n).ratio() for n in table}
        best = max(ratio.values(), default=0.0)
        close = [n for n in table if ratio[n] == best] if best >= 0.6 else []
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ConfigError(f"key '{key}' has unknown value {name!r}{hint}; choose one of: {', '.join(table)} (or "
                          f"give 'package.module:function')") from None


def choices(kind: str) -> str:
    """The --help text of a key naming a `kind`: its registered names, then the dotted-path form."""
    return " | ".join(names(kind)) + " | package.module:function"


def names(kind: str) -> tuple[str, ...]:
    """Registered names of `kind`, in registration order (empty for an unknown kind)."""
    return tuple(_TABLES.get(kind, {}))
