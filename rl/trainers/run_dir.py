"""A run's output directory before training: a new run over a previous one is refused unless `resume` or
`overwrite=true` says what to do, and the main process holds the directory's run lock from then on
(`check_output_dir`, called by the launch scripts and by a trainer's first `train()`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rl.engine.state import checkpoint_dir, hold_run_lock, previous_run
from rl.errors import RunError


def _previous(cfg, out: Path) -> str | None:
    """What of a previous run `out` holds (None on resume, or when nothing); refused without overwrite=true."""
    found = None if cfg.resume else previous_run(out)
    if found is not None and not getattr(cfg, "overwrite", False):
        raise RunError(f"output_dir={out} holds a previous run ({found}); pass resume=auto to continue it, "
                       f"overwrite=true to replace it, or another output_dir")
    return found


def check_output_dir(cfg) -> None:
    """Refuse to start a new run over a previous one, or beside a live one: the main process holds the
    directory's run lock from here to its exit (`hold_run_lock`). With overwrite=true clear the previous
    run's metrics and checkpoints (a later resume=auto must not pick up the old run's checkpoints)."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise RunError(f"output_dir={out} is a file; give a directory")
    found = _previous(cfg, out)  # before the lock: a refused run writes nothing into output_dir
    if os.environ.get("RANK", "0") == "0":  # the main process (accelerate launch sets RANK on each)
        hold_run_lock(out)
        found = _previous(cfg, out)  # again: another run may have written there before the lock was ours
    if found is not None:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(checkpoint_dir(out), ignore_errors=True)
