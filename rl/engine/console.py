"""The console line of a logging step: what a run prints while it trains, one line per logged row, on the
main process, to stdout (so also into a log file or a pipe, where the progress bar is off).

    step    4/10 | loss   0.1234 | reward    0.375 | kl 0.001234 | learning_rate 1.00e-03 | tokens/s 1,234 | elapsed 0:00:12 | eta 0:00:18

The columns are the metric names TRL users read (`loss`, `reward`, `objective/kl`, `rewards/accuracies`,
`rewards/margins`, ...), chosen once per run from the first training row (`KEY_FIGURES`, at most
`MAX_FIGURES` of them), each with a fixed width, so that the lines of a run line up in a terminal and
`cut`/`awk` read a column by its position; a figure a later row lacks shows `-`. Held-out metrics follow the
fixed columns on the rows that have them. `tokens/s` is `train_tokens_per_second` (tokens through the
forward-backward on every process, per wall second since the previous logged row; rl.trainers.base).
Elapsed and ETA count from the start of the training loop (a resumed run: from the resume), the ETA as the
mean time of this run's steps times the steps left. `quiet: true` (`--quiet`) turns the line off; the
trackers (`report_to`) are untouched either way.
"""

from __future__ import annotations

import math

# the trainers' key figures, in the order shown; a run shows those of its first training row
KEY_FIGURES = ("loss", "loss/policy", "loss/value", "reward", "reward_std", "objective/scores", "objective/kl",
               "kl", "kl_coef", "rewards/accuracies", "rewards/margins", "accuracy", "margin", "mean_token_accuracy",
               "on_policy", "grad_norm")
MAX_FIGURES = 6
EVAL_WORDS = ("loss", "accura", "reward", "score", "margin")  # held-out metrics worth a place on the line
MAX_EVAL = 3


def choose_columns(row: dict) -> list[str]:
    """The key figures present in `row` (a run's first training row), in KEY_FIGURES order, at most MAX_FIGURES
    (grad_norm is the first to go)."""
    found = [k for k in KEY_FIGURES if _number(row.get(k))]
    return found[:MAX_FIGURES]


def value_text(key: str, value) -> str:
    """One figure in a fixed width of 9: four decimals from 0.001 to 10,000 (and 0), else scientific."""
    if isinstance(value, str):  # a non-finite value as the tracker keeps it ("nan", "inf")
        return f"{value:>9}"
    if not _number(value):
        return f"{'-':>9}"
    if not math.isfinite(value):
        return f"{value!s:>9}"
    if key == "learning_rate":
        return f"{value:.2e}"
    text = f"{value:.4f}" if value == 0 or 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"
    return f"{text:>9}"


def clock(seconds: float | None) -> str:
    """h:mm:ss ('-' when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def console_line(step: int, total: int | None, row: dict, columns: list[str], elapsed: float,
                 eta: float | None) -> str:
    """The line of one logged row (see the module docstring). A row without training metrics (the
    evaluation before the first step) shows its held-out metrics in the figures' place."""
    width = len(str(total)) if total else 1
    parts = [f"step {step:>{width}}/{total if total else '?'}"]
    training = any(_number(row.get(k)) for k in columns)
    if training:
        parts += [f"{k} {value_text(k, row.get(k))}" for k in columns]
        if _number(row.get("learning_rate")):
            parts.append(f"learning_rate {value_text('learning_rate', row['learning_rate'])}")
        rate = row.get("train_tokens_per_second")
        parts.append(f"tokens/s {format(round(rate), ','):>7}" if _number(rate) and math.isfinite(rate)
                     else f"tokens/s {'-':>7}")
    parts += [f"elapsed {clock(elapsed)}", f"eta {clock(eta)}"]
    held_out = [k for k in row if k.startswith("eval/") and _number(row[k]) and any(w in k for w in EVAL_WORDS)]
    parts += [f"{k} {value_text(k, row[k]).strip()}" for k in held_out[:MAX_EVAL]]
    return " | ".join(parts)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
