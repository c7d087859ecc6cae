"""Metrics: a console line per logged row (rl.engine.console), a live progress bar, a JSONL file, accelerate's
trackers (TensorBoard, wandb, trackio, MLflow) and a PNG plot; `CallbackTracker` for library calls without one.

Only the main process writes; the others get a Tracker that does nothing, so trainers call it
unconditionally. Metric names are the ones TRL users read (`loss`, `learning_rate`, `num_tokens`,
`rewards/chosen`, `objective/kl`, held-out metrics under `eval/`).

The sinks other than jsonl are accelerate's own tracker classes (`accelerate.tracking`), the ones
`Accelerator(log_with=...)` builds, used directly because our Accelerator is built before the
output directory and run name are known. wandb runs offline unless the user set WANDB_MODE.
`quiet_third_party` hides other libraries' warnings, loading bars and DeepSpeed's sub-ERROR log.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from rl.config.schema import SINKS
from rl.engine.console import choose_columns, console_line
from rl.errors import RunError

logger = logging.getLogger(__name__)

# Shown in the progress bar when present, in this order.
BAR_KEYS = ("loss", "objective/scores", "reward", "rewards/accuracies", "accuracy", "objective/kl",
            "eval/loss", "eval/accuracy", "learning_rate")


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """Nested sections -> dotted keys (`lora.rank`); lists and None -> strings. TensorBoard's hparams
    take only scalars and strings."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def build_trackers(report_to, output_dir: Path, run_name: str, config: dict) -> list:
    """Started accelerate trackers for the sinks in `report_to` (jsonl is ours, not accelerate's).
    TensorBoard writes `<output_dir>/runs/<run_name>` (where TRL's logging_dir puts it), wandb
    `<output_dir>/wandb` (offline unless WANDB_MODE says otherwise), MLflow the experiment `run_name`
    in MLFLOW_TRACKING_URI (unset: a file store `<output_dir>/mlruns`), trackio the project
    TRACKIO_PROJECT (default `rl`), run `run_name`, in its local store TRACKIO_DIR (default
    `~/.cache/huggingface/trackio`; `trackio show` opens it). Configurations go in as dotted scalars
    (`lora.rank`) except to wandb, which keeps sections."""
    from accelerate import PartialState, tracking

    if report_to and any(SINKS.get(s) for s in report_to):
        PartialState()  # accelerate's trackers log through its state; the run's Accelerator made it already
    trackers = []
    for sink in report_to:
        if sink == "tensorboard":
            trackers.append(tracking.TensorBoardTracker(run_name, output_dir / "runs"))
        elif sink == "wandb":
            # Offline unless the user configured wandb; never prompt for a login.
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            trackers.append(tracking.WandBTracker(os.environ.get("WANDB_PROJECT", "rl"), name=run_name,
                                                  dir=str(output_dir), reinit="finish_previous"))
        elif sink == "trackio":
            trackers.append(tracking.TrackioTracker(os.environ.get("TRACKIO_PROJECT", "rl"), name=run_name))
        elif sink == "mlflow":
            # an unreachable server fails in seconds, not after MLflow's default minutes of retries
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            import mlflow

            if os.environ.get("MLFLOW_TRACKING_URI"):  # the user's server wins over an earlier run's store
                mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
            else:
                # MLflow 3's own default is sqlite:///mlflow.db in the working directory, which needs
                # SQLAlchemy (mlflow-skinny has none); its file store needs this opt-in since 3.x
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                mlflow.set_tracking_uri((output_dir / "mlruns").resolve().as_uri())
            trackers.append(tracking.MLflowTracker(run_name, logging_dir=str(output_dir / "mlruns"),
                                                   run_name=run_name))
    for t in trackers:
        try:
            t.start()
            t.store_init_configuration(config if t.name == "wandb" else flat_config(config))
        except Exception as e:  # noqa: BLE001 - a sink that cannot start (a server down, a bad URI): one line
            raise RunError(f"report_to={t.name}: the tracker could not start ({type(e).__name__}: "
                           f"{(str(e).splitlines() or [''])[0][:200]}); check its server or settings "
                           f"(e.g. MLFLOW_TRACKING_URI), or drop {t.name} from report_to") from None
    return trackers


def quiet_third_party(verbose: bool = False) -> None:
    """Hide other libraries' noise unless `verbose`: FutureWarning / DeprecationWarning (a 2-process
    ZeRO-3 run printed 2,315 DeepSpeed FutureWarnings; transformers' deprecated `past_key_values`
    keyword is one too), transformers' and the hub's loading bars (they interleave with our bar), and
    DeepSpeed's log below ERROR. Call it once per process, first thing (the launch scripts do, in
    `preflight`); errors and our own output are untouched."""
    if verbose:
        return
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    # read by these libraries when they are imported (here or in a child process) ...
    for key, value in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
                       ("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")):
        os.environ.setdefault(key, value)
    # ... and applied directly when they already are
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    # DeepSpeed sets its logger's level when it is imported; a filter on the logger stays
    ds = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _ErrorsOnly) for f in ds.filters):
        ds.addFilter(_ErrorsOnly())


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def progress_bar_wanted() -> bool:
    """The live bar only on a terminal: tqdm redraws with carriage returns, which in a log file (nohup, Slurm's
    output, `| tee`) splice every update into one long line. RL_NO_PROGRESS=1 turns it off on a terminal too,
    RL_NO_PROGRESS=0 forces it on where stderr (tqdm's stream) is not a terminal."""
    forced = os.environ.get("RL_NO_PROGRESS")
    if forced in ("0", "1"):
        return forced == "0"
    return sys.stderr.isatty()


class CallbackTracker:
    """The tracker interface `fit` needs, for library calls without a Tracker: each logged row goes to
    `log_fn(step, metrics)` (or nowhere), notes go to the module logger."""

    def __init__(self, log_fn=None):
        self.log_fn = log_fn

    def log(self, step: int, metrics: dict) -> None:
        if self.log_fn is not None:
            self.log_fn(step, metrics)

    def write(self, message: str) -> None:
        logger.info(message)

    def close(self) -> None:
        pass


class Tracker:
    def __init__(self, output_dir: str | os.PathLike, report_to: list[str] | tuple[str, ...] = ("jsonl",),
                 run_name: str | None = None, config: dict | None = None, total_steps: int | None = None,
                 is_main: bool = True, desc: str = "train", plot_keys: list[str] | None = None,
                 console: bool | None = None):
        """`console`: print a line per logged row (rl.engine.console); None: unless the config says quiet."""
        self.is_main = is_main
        self.output_dir = Path(output_dir)
        self.history: list[dict[str, Any]] = []
        self.plot_keys = plot_keys
        self._bar = None
        self._trackers: list = []
        self._file = None
        self._start = self._loop_start = time.time()
        self._console = is_main and (not (config or {}).get("quiet") if console is None else console)
        self._columns: list[str] | None = None  # the console's figures, fixed by the first training row
        self._total, self._first_step = total_steps, 0
        if not is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in report_to:
            self._file = (self.output_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._trackers = build_trackers(report_to, self.output_dir, run_name or self.output_dir.name, config or {})
        self._desc = desc
        if total_steps is not None:  # else the bar starts when its total is known (set_total) or at the first log
            self._start_bar(total_steps)

    def _start_bar(self, total_steps: int | None) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total_steps, desc=self._desc, dynamic_ncols=True, disable=not progress_bar_wanted())

    def set_total(self, total_steps: int, done: int = 0) -> None:
        """The run's total steps, when only the training loop knows it, and the steps already `done` (a resumed
        run's): the lifecycle calls this as its loop starts, where the console's elapsed time and ETA count from."""
        self._total, self._first_step, self._loop_start = total_steps, done, time.time()
        if not self.is_main:
            return
        if self._bar is None:
            self._start_bar(total_steps)
        elif self._bar.total != total_steps:
            self._bar.total = total_steps
            self._bar.refresh()

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
        if self._trackers:
            # every tracker stamps its own wall time (trackio reserves the name `time`)
            numeric = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
            for t in self._trackers:
                t.log(numeric, step=step)
        if self._bar is None:
            self._start_bar(None)
        if self._bar is not None:
            shown = {k.split("/")[-1] if k.count("/") else k: f"{row[k]:.4g}" for k in BAR_KEYS
                     if isinstance(row.get(k), (int, float))}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
        if self._console:
            self.write(self.console_text(step, row))

    def console_text(self, step: int, row: dict) -> str:
        """The console line of a logged row (rl.engine.console), with the run's fixed columns."""
        if self._columns is None and choose_columns(row):
            self._columns = choose_columns(row)
        elapsed = time.time() - self._loop_start
        done = step - self._first_step
        eta = elapsed / done * (self._total - step) if done > 0 and self._total else None
        return console_line(step, self._total, row, self._columns or [], elapsed, eta)

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
        for t in self._trackers:
            _finish_trackio(t) if getattr(t, "name", None) == "trackio" else t.finish()
        return plot_history(self.history, self.output_dir / "metrics.png", self.plot_keys)


def _finish_trackio(tracker) -> None:
    """trackio's own `finish()`, quietly. accelerate's tracker calls `run.finish()`, which leaves the run
    current, so trackio's atexit hook finished it again and printed "* Run finished. Uploading logs to
    Trackio" when the process ended (the last line of a pytest session); its first print of that line
    is noise beside our own final line too."""
    import contextlib
    import io

    import trackio

    with contextlib.redirect_stdout(io.StringIO()):
        current = getattr(getattr(trackio, "context_vars", None), "current_run", None)
        if current is not None and current.get() is tracker.run:
            trackio.finish()  # finishes the run and clears it, so the atexit hook has nothing left to do
        else:
            tracker.finish()


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
    from matplotlib.ticker import MaxNLocator

    numeric = [k for k in dict.fromkeys(k for row in history for k in row)
               if k not in ("step", "time") and any(isinstance(r.get(k), (int, float)) for r in history)]
    if keys:
        numeric = [k for k in keys if k in numeric] or numeric
    # a series that never changes (a constant learning rate, a clip count of 0) is a flat line that takes a
    # panel from one that moves; a run where nothing moves (one logged step) keeps its panels
    numeric = [k for k in numeric if len({r[k] for r in history if isinstance(r.get(k), (int, float))}) > 1] or numeric
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
        ax.set_ylabel(y_label(key), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole: no "2.5" ticks
    for ax in list(axes.flat)[len(numeric):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def y_label(key: str) -> str:
    """A panel's y-axis label: the metric's last name part in words (`eval/rewards/accuracies` ->
    `accuracies`, `learning_rate` -> `learning rate`); the title keeps the full key."""
    return key.rsplit("/", 1)[-1].replace("_", " ")
