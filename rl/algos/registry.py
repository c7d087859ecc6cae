"""A tiny name -> function registry, one table per kind of algorithm piece.

Kinds used in rl.algos: "advantage_estimator", "policy_loss", "kl_estimator", "preference_loss".
A new variant is one decorated function:

    @register("advantage_estimator", "my_estimator")
    def my_advantages(rewards, num_generations): ...

and `get("advantage_estimator", "my_estimator")` finds it (a config names it by that string).
"""

from __future__ import annotations

from typing import Callable

_TABLES: dict[str, dict[str, Callable]] = {}


def register(kind: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator: file `fn` under `kind`/`name`; a name registered twice is a programming error."""

    def deco(fn: Callable) -> Callable:
        table = _TABLES.setdefault(kind, {})
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__qualname__})")
        table[name] = fn
        return fn

    return deco


def get(kind: str, name: str) -> Callable:
    """The function registered as `kind`/`name`; a one-line ValueError listing the valid names otherwise."""
    table = _TABLES.get(kind)
    if table is None:
        raise ValueError(f"unknown registry kind {kind!r}; kinds: {', '.join(sorted(_TABLES))}")
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(table)}")
    return table[name]


def names(kind: str) -> tuple[str, ...]:
    """Registered names of `kind`, in registration order (empty for an unknown kind)."""
    return tuple(_TABLES.get(kind, {}))
