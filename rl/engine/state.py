"""Finding checkpoints to resume from, and stopping cleanly on SIGUSR1/SIGTERM (Slurm preemption).

Checkpoints are directories `<output_dir>/checkpoints/checkpoint-<step>` written atomically by
`ForwardBackwardPipeline.save_state` (a `COMPLETE` marker is the last file written before the rename),
so a directory without the marker is an interrupted write and is never resumed from.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"


def check_checkpoint_name(name) -> str:
    """A checkpoint name is one plain path component, so `<checkpoint_dir>/<name>` (and its
    `.tmp-<name>` / `.old-<name>` siblings) stay inside `checkpoint_dir`. Raises ValueError otherwise.

    Refused: empty, `/` or `\\` (a path, absolute or not), a leading `.` (`.`, `..`, hidden names,
    and our own `.tmp-*` / `.old-*` work directories) and NUL."""
    rule = "a checkpoint name must be one path component: no '/', '\\', NUL, no leading '.', not empty"
    if not isinstance(name, str):
        raise ValueError(f"checkpoint name {name!r} is not a string; {rule}")
    if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise ValueError(f"checkpoint name {name!r} is refused; {rule}")
    return name


def _dedupe_shared(state_dict: dict) -> dict:
    """safetensors refuses tensors that share memory (tied embeddings); keep one copy of each."""
    seen: dict[tuple, str] = {}
    out = {}
    for k, v in state_dict.items():
        v = v.detach().cpu().contiguous()
        key = (v.data_ptr(), v.shape, v.dtype) if v.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = k
        out[k] = v
    return out


def _load_state_dict(model: torch.nn.Module, sd: dict) -> None:
    """Load a (deduplicated) state dict; a missing key is fine only if it is tied to a loaded one."""
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected:
        raise KeyError(f"checkpoint has parameters the model lacks: {unexpected[:5]}")
    if missing:
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded_ptrs = {params[k].data_ptr() for k in sd if k in params}
        untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded_ptrs]
        if untied:
            raise KeyError(f"checkpoint lacks parameters of the model: {untied[:5]}")


def _torch_rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.stack([s for s in torch.cuda.get_rng_state_all()])
    return state


def _set_torch_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _py_rng_state():
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _set_py_rng_state(state) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))


def _np_rng_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _set_np_rng_state(state) -> None:
    np.random.set_state((state[0], np.array(state[1], dtype=np.uint32), state[2], state[3], state[4]))

_STEP = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `<output_dir>/checkpoints`, or None."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return None
    found = []
    for d in root.iterdir():
        m = _STEP.match(d.name)
        if m and d.is_dir() and (d / COMPLETE_MARKER).exists():
            found.append((int(m.group(1)), d))
    return max(found)[1] if found else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """`resume: auto` -> newest complete checkpoint (None if there is none yet); a path -> that path."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / COMPLETE_MARKER).exists():
        raise FileNotFoundError(f"resume={resume}: not a complete checkpoint directory")
    return path


class StopSignal:
    """Turns SIGUSR1/SIGTERM into a flag the training loop checks after each optimizer step.

    Slurm sends SIGUSR1 (with `--signal=USR1@<secs>`) before the time limit and SIGTERM on
    preemption; the trainer then finishes its step, writes a checkpoint and exits so the job
    can be requeued and continue with `resume: auto`."""

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.received: int | None = None
        self._previous = {}
        for s in signals:
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not in the main thread: no handler, no flag
                pass

    def _handle(self, signum, frame):  # noqa: ARG002
        self.received = signum

    @property
    def stop(self) -> bool:
        return self.received is not None

    def agreed(self, accelerator) -> bool:
        """True on every process if any process got the signal: all ranks must stop at the same
        step, or the next collective would hang. Call it at the same point on every process."""
        if accelerator.num_processes == 1:
            return self.stop
        import torch

        flag = torch.tensor([1.0 if self.stop else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, "max").item() > 0)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

_STEP = re.compile(r"^checkpoint-(\d+)$")


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under `<output_dir>/checkpoints`, newest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir()
             if (m := _STEP.match(d.name)) and d.is_dir() and (d / COMPLETE_MARKER).exists()]
    return [d for _, d in sorted(found, reverse=True)]


def prune_checkpoints(output_dir: str | Path, keep: int | None, parts=lambda name: ()) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, each with the directories `parts(name)` that
    belong to it (a trainer's second engine, e.g. PPO's critic); return the deleted."""
    if not keep:
        return []
    gone = complete_checkpoints(output_dir)[keep:]
    for d in gone:
        for path in (d, *parts(d.name)):
            shutil.rmtree(path, ignore_errors=True)
    return gone


def previous_run(output_dir: str | Path) -> str | None:
    """What in `output_dir` shows an earlier run (None when it is empty or fresh)."""
    out = Path(output_dir)
    for name in ("metrics.jsonl", "model.safetensors", "adapter_model.safetensors", "reward_config.json"):
        if (out / name).exists():
            return name
    if complete_checkpoints(out):
        return "checkpoints/"
    return None
