"""Metrics: a live progress bar, a JSONL file, wandb (offline unless configured) and a PNG plot.

Only the main process writes; the others get a Tracker that does nothing, so trainers call it
unconditionally. Metric names follow TRL (`loss`, `rewards/chosen`, `objective/kl`, ...).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

# Shown in the progress bar when present, in this order.
BAR_KEYS = ("loss", "objective/scores", "reward", "rewards/accuracies", "accuracy", "objective/kl",
            "eval/loss", "eval/accuracy", "lr")


class Tracker:
    def __init__(self, output_dir: str | os.PathLike, report_to: list[str] | tuple[str, ...] = ("jsonl",),
                 run_name: str | None = None, config: dict | None = None, total_steps: int | None = None,
                 is_main: bool = True, desc: str = "train", plot_keys: list[str] | None = None):
        self.is_main = is_main
        self.output_dir = Path(output_dir)
        self.history: list[dict[str, Any]] = []
        self.plot_keys = plot_keys
        self._bar = None
        self._wandb = None
        self._file = None
        self._start = time.time()
        if not is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in report_to:
            self._file = (self.output_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if "wandb" in report_to:
            # Offline unless the user configured wandb; never prompt for a login.
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "rl"),
                                     name=run_name or self.output_dir.name, config=config or {},
                                     dir=str(self.output_dir), reinit="finish_previous")
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total_steps, desc=desc, dynamic_ncols=True,
                         disable=os.environ.get("RL_NO_PROGRESS") == "1")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record `metrics` at optimizer step `step`; the bar moves to `step`."""
        if not self.is_main:
            return
        row = {"step": step, "time": round(time.time() - self._start, 3)}
        row.update({k: _scalar(v) for k, v in metrics.items()})
        self.history.append(row)
        if self._file:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._bar is not None:
            shown = {k.split("/")[-1] if k.count("/") else k: f"{row[k]:.4g}" for k in BAR_KEYS
                     if isinstance(row.get(k), (int, float))}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(0, step - self._bar.n))

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> Path | None:
        """Flush, close the sinks and write `<output_dir>/metrics.png`; returns the plot path."""
        if not self.is_main:
            return None
        if self._bar is not None:
            self._bar.close()
        if self._file:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        return plot_history(self.history, self.output_dir / "metrics.png", self.plot_keys)


def _scalar(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v


def plot_history(history: list[dict], path: Path, keys: list[str] | None = None, max_panels: int = 9) -> Path | None:
    """One small panel per numeric metric (x = optimizer step); nothing written without data."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = [k for k in dict.fromkeys(k for row in history for k in row)
               if k not in ("step", "time") and any(isinstance(r.get(k), (int, float)) for r in history)]
    if keys:
        numeric = [k for k in keys if k in numeric] or numeric
    numeric = numeric[:max_panels]
    if not numeric:
        return None
    cols = min(3, len(numeric))
    rows = math.ceil(len(numeric) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, numeric):
        pts = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(numeric):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
