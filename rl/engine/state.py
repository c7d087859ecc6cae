"""Checkpoints: the pipeline's checkpoint format (written and read), RNG state, finding checkpoints
to resume from, retention, and stopping cleanly on SIGUSR1/SIGTERM (Slurm preemption).

A checkpoint is a directory `<checkpoint_dir>/<name>` (trainers: `<output_dir>/checkpoints/checkpoint-<step>`)
written by `save_pipeline_state` (`ForwardBackwardPipeline.save_state`, on every process):

    model.safetensors            the full state dict, tied tensors once (gathered under ZeRO-3); or the
                                 files of the model's own `save_checkpoint_weights` (PPO's policy +
                                 value head, a reward model), read back by its `load_checkpoint_weights`
    optimizer.pt | deepspeed/    the optimizer state (under DeepSpeed its own sharded checkpoint)
    scheduler.pt                 when the pipeline has a scheduler
    rng_<rank>.pt                each process's torch CPU (and CUDA) generator state
    per_process_<rank>.pt        `extra_state["per_process"]` when given: what differs between processes
                                 (tensors, e.g. GRPO's generation batch between its updates); each
                                 process passes its own and gets its own back under the same key
    state.json                   step, micro_step, gradient_accumulation_steps, num_processes, Python and
                                 NumPy RNG state, the rest of the caller's `extra_state`
    ...                          whatever `pipeline.before_commit(tmp_dir)` writes, if set (a trainer's
                                 `config.json` or adapter files and tokenizer, for `from_pretrained`)
    COMPLETE                     the last file written

It is written into `.tmp-<name>` and renamed when complete (the previous one moved to `.old-<name>`
first and deleted after), so a crash mid-save leaves the previous checkpoint loadable, and a directory
without the marker is an interrupted write that is never loaded or resumed from. Nothing is unpickled
on load (`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
from pathlib import Path

import numpy as np
import torch

from rl.engine.dist import inner_optimizer, is_deepspeed
from rl.errors import RunError, disk_full

COMPLETE_MARKER = "COMPLETE"
PER_PROCESS = "per_process"  # the key of `extra_state` written per process, not into state.json


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


# ------------------------------------------------------------------------------ the pipeline's checkpoint

def save_pipeline_state(pipeline, name: str, extra_state: dict) -> dict:
    """Write `<pipeline.checkpoint_dir>/<name>` atomically (the format in the module docstring) from a
    `ForwardBackwardPipeline`'s model, optimizer, scheduler, counters and RNG state; the body of its
    `save_state` request. Call it on every process (ZeRO-3 gathers the state dict collectively).
    Returns the reference's dict `path`, `model_path`, `optimizer_path`, `state_path`."""
    acc = pipeline.accelerator
    final = pipeline.checkpoint_dir / name
    tmp = pipeline.checkpoint_dir / f".tmp-{name}"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    # The full state dict (gathered under ZeRO-3: every rank must take part).
    state_dict = acc.get_state_dict(pipeline.model)
    if acc.is_main_process:
        from safetensors.torch import save_file

        write = getattr(pipeline.unwrapped_model, "save_checkpoint_weights", None)
        if write is not None:  # a model of ours (PPO's policy + value head, a reward model) writes the
            write(state_dict, tmp)  # files `from_pretrained` reads; `load_checkpoint_weights` reads them back
        else:
            save_file(_dedupe_shared(state_dict), str(tmp / "model.safetensors"))
    if is_deepspeed(acc):
        pipeline.model.save_checkpoint(str(tmp / "deepspeed"), tag="state")  # sharded optimizer
        optimizer_path = tmp / "deepspeed"
    else:
        optimizer_path = tmp / "optimizer.pt"
        if acc.is_main_process and pipeline.optimizer is not None:
            torch.save(pipeline.optimizer.state_dict(), optimizer_path)
    if acc.is_main_process and pipeline.scheduler is not None:
        torch.save(pipeline.scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(_torch_rng_state(), tmp / f"rng_{acc.process_index}.pt")
    extra_state = dict(extra_state)
    local = extra_state.pop(PER_PROCESS, None)
    if local is not None:  # before the marker: a checkpoint is complete with every process's part or not at all
        torch.save(local, tmp / f"{PER_PROCESS}_{acc.process_index}.pt")
    acc.wait_for_everyone()
    if acc.is_main_process:
        state = {"step": pipeline.step, "micro_step": pipeline.micro_step,
                 "gradient_accumulation_steps": pipeline.gradient_accumulation_steps,
                 "num_processes": acc.num_processes, "python_rng": _py_rng_state(),
                 "numpy_rng": _np_rng_state(), "extra": extra_state}
        (tmp / "state.json").write_text(json.dumps(state))
        if pipeline.before_commit is not None:  # inside the atomic write: loadable from the moment it exists
            pipeline.before_commit(tmp)
        (tmp / COMPLETE_MARKER).write_text("ok\n")
    acc.wait_for_everyone()
    if acc.is_main_process:
        old = pipeline.checkpoint_dir / f".old-{name}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    rel = optimizer_path.name
    return {"path": str(final), "model_path": str(final / "model.safetensors"),
            "optimizer_path": str(final / rel), "state_path": str(final / "state.json")}


def load_pipeline_state(pipeline, path: Path) -> dict:
    """Restore into a `ForwardBackwardPipeline` what `save_pipeline_state` wrote at `path` (weights,
    optimizer, scheduler, this process's RNG state, step counters; the gradients cleared); the body
    of its `load_state` request. Returns the `extra_state` saved with it."""
    acc = pipeline.accelerator
    if not (path / COMPLETE_MARKER).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} file)")
    state = json.loads((path / "state.json").read_text())
    if is_deepspeed(acc):
        pipeline.model.load_checkpoint(str(path / "deepspeed"), tag="state", load_module_strict=True,
                                       load_optimizer_states=True, load_lr_scheduler_states=False)
    else:
        from safetensors.torch import load_file

        # safetensors rejects "cpu:0" (the device of rank 0 in a multi-process CPU run); load_state_dict
        # copies into the parameters on their own device anyway.
        read = getattr(pipeline.unwrapped_model, "load_checkpoint_weights", None)
        if read is not None:
            read(path)
        else:
            load_deduped_state_dict(pipeline.unwrapped_model, load_file(str(path / "model.safetensors"), device="cpu"))
        opt_path = path / "optimizer.pt"
        if pipeline.optimizer is not None and opt_path.exists():
            # map to CPU for the same reason; load_state_dict moves the state to each parameter's device
            pipeline.optimizer.load_state_dict(torch.load(opt_path, map_location="cpu", weights_only=True))
    if pipeline.scheduler is not None and (path / "scheduler.pt").exists():
        pipeline.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_path = path / f"rng_{acc.process_index}.pt"
    if rng_path.exists():
        _set_torch_rng_state(torch.load(rng_path, weights_only=True))
    _set_py_rng_state(state["python_rng"])
    _set_np_rng_state(state["numpy_rng"])
    pipeline.step, pipeline.micro_step = state["step"], state["micro_step"]
    if pipeline.optimizer is not None:
        inner_optimizer(pipeline.optimizer).zero_grad(set_to_none=True)
    extra = dict(state.get("extra", {}))
    local_path = path / f"{PER_PROCESS}_{acc.process_index}.pt"
    if local_path.exists():
        extra[PER_PROCESS] = torch.load(local_path, map_location="cpu", weights_only=True)
    return extra


# ------------------------------------------------------------------------------ weights and RNG state

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


def load_deduped_state_dict(model: torch.nn.Module, sd: dict) -> None:
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


# ------------------------------------------------------------------------------ discovery and resume

_STEP = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under `<output_dir>/checkpoints`, newest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir()
             if (m := _STEP.match(d.name)) and d.is_dir() and (d / COMPLETE_MARKER).exists()]
    return [d for _, d in sorted(found, reverse=True)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `<output_dir>/checkpoints`, or None."""
    found = complete_checkpoints(output_dir)
    return found[0] if found else None


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


# ------------------------------------------------------------------------------ retention

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


RUN_LOCK = ".rl-run.lock"  # in output_dir: flock-ed by the run's main process, its pid and host inside
_held: dict[str, object] = {}  # resolved output_dir -> the open lock file, kept open (locked) until exit


def hold_run_lock(output_dir: str | Path) -> None:
    """Take `<output_dir>/RUN_LOCK` (an exclusive `flock`) for the rest of this process's life, so that a
    second run into the same directory is refused however close behind it starts (the check for a previous
    run alone let through one that started before the first wrote its metrics.jsonl). The kernel drops the
    lock when the process ends, a crash or SIGKILL too, so a stale file never blocks. A second call for the
    same directory in this process (the launch script, then `train()`) is a no-op. Call it on the main
    process only: the other ranks of the same run would be refused. Raises RunError naming the directory
    and the holder."""
    out = Path(output_dir)
    key = str(out.resolve())
    if key in _held:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / RUN_LOCK, "a+")  # never truncated before the lock is ours: it names the holder
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that is starting"
            f.close()
            raise RunError(f"output_dir={out} is in use by another run ({holder}, holding {out / RUN_LOCK}); wait "
                           f"for it to end, or give another output_dir") from None
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
    except OSError as e:  # a run's first write: a full disk is one line, before any model is built
        if not disk_full(e):
            raise
        raise RunError(f"no space left on {out} while starting the run (writing {RUN_LOCK}); free space there or "
                       f"give another output_dir, then rerun") from None
    _held[key] = f


@atexit.register
def _release_run_locks() -> None:
    """At exit, the held lock files closed: the kernel drops the locks with the process anyway, but a file left
    open to the interpreter's teardown is a ResourceWarning in a user's script run with warnings as errors."""
    while _held:
        _held.popitem()[1].close()


# ------------------------------------------------------------------------------ preemption

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
        flag = torch.tensor([1.0 if self.stop else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, "max").item() > 0)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


_MISMATCH = re.compile(r"size mismatch for ([^:]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                       r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")


def checkpoint_load_error(e: BaseException) -> tuple[str, str]:
    """Why a checkpoint did not load, in one line, and the fix when it is known ("; ..." or ""). torch's
    load_state_dict puts the detail (which tensor, the two shapes) on the lines below "Error(s) in loading
    state_dict for X:", one line per tensor: keep the first tensor, count the rest, say what changes a shape."""
    text = str(e)
    found = _MISMATCH.findall(text)
    if found:
        name, saved, now = found[0]
        more = f", and {len(found) - 1} more tensors" if len(found) > 1 else ""
        return (f"size mismatch for {name}: {saved} in the checkpoint, {now} in this run's model{more}",
                "; the model differs from the one that wrote it (a changed lora.rank, lora.target_modules or "
                "model_name?): resume with the settings it was written with, or start a new output_dir")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (f"{type(e).__name__}: {'; '.join(lines[:2])[:300]}" if lines else type(e).__name__), ""
