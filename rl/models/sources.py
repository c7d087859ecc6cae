"""Model names to loadable directories: `resolve_model_path` maps `tiny:<family>[-classifier]` to a tiny
model written locally on first use (rl.models.tiny, under `$RL_TINY_CACHE`, default
`~/.cache/rl-tiny`), a `.gguf` file or a packaged name to its converted directory (rl.models.gguf), and
passes any other name (a hub id, a local directory) through unchanged.

Recipes name `model_name: tiny:llama` so that a fresh machine runs them without any download.
"""

from __future__ import annotations

import os
from pathlib import Path

from rl.models.gguf import resolve
from rl.models.tiny import write_tiny_model

TINY_PREFIX = "tiny:"


def resolve_model_path(name: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Map `tiny:<family>[-classifier][-hd64]` to a locally written tiny model, a GGUF file or packaged real
    model (`smollm2-135m-instruct`) to its converted directory (see rl.models.gguf); others pass through.

    Recipes name `model_name: tiny:llama` so that a fresh machine runs them without any download.
    """
    if not name.startswith(TINY_PREFIX):
        return resolve(name)
    spec = name[len(TINY_PREFIX):]
    family, *options = spec.split("-")
    unknown = set(options) - {"classifier", "hd64"}
    if unknown:
        raise ValueError(f"unknown tiny model option {'-'.join(sorted(unknown))!r} in {name!r}: tiny:<family>"
                         f"[-classifier][-hd64]")
    task = "classifier" if "classifier" in options else "causal-lm"
    # hd64: hidden 128 in 2 heads, a head_dim of 64, the smallest vLLM's CPU attention accepts (16 is refused)
    shape = dict(hidden=128, heads=2) if "hd64" in options else {}
    root = Path(cache_dir or os.environ.get("RL_TINY_CACHE", Path.home() / ".cache" / "rl-tiny"))
    return str(write_tiny_model(root / spec, family=family, task=task, **shape))
