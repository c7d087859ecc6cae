"""Finding checkpoints to resume from, and stopping cleanly on SIGUSR1/SIGTERM (Slurm preemption).

Checkpoints are directories `<output_dir>/checkpoints/checkpoint-<step>` written atomically by
`ForwardBackwardPipeline.save_state` (a `COMPLETE` marker is the last file written before the rename),
so a directory without the marker is an interrupted write and is never resumed from.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from rl.forward_backward import COMPLETE_MARKER
from rl.models import is_lora

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


def make_loadable(ckpt: str | Path, model, tokenizer=None) -> bool:
    """Write what `from_pretrained` needs beside a checkpoint's weights, as TRL's `checkpoint-N/` hold it:
    for a plain causal LM its `config.json` (+ generation config), for a LoRA model the PEFT adapter
    (`adapter_config.json` + `adapter_model.safetensors`, its tensors read from the checkpoint's
    `model.safetensors`, so ZeRO-3 needs no second gather), and the tokenizer. Models of our own that
    write their checkpoint files themselves (`save_checkpoint_weights`: PPO's policy with its value
    head, reward models) already did; they get the tokenizer. Any other model: returns False.
    Call it on one process."""
    from transformers import PreTrainedModel

    ckpt = Path(ckpt)
    if hasattr(model, "save_checkpoint_weights"):
        pass
    elif is_lora(model):
        from safetensors import safe_open

        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            adapter = {k: f.get_tensor(k) for k in f.keys() if ".lora_" in k or ".modules_to_save." in k}
        model.save_pretrained(str(ckpt), state_dict=adapter, safe_serialization=True)
    elif isinstance(model, PreTrainedModel):
        model.config.save_pretrained(ckpt)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(ckpt)
    else:
        return False
    if tokenizer is not None:
        tokenizer.save_pretrained(ckpt)
    return True
