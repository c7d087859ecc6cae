"""The launch code of every trainer, the pipeline, chat and eval, inside the package (`python -m
rl.scripts.<name>`, `rl-train`); `launch/<name>.py` are the few-line entry points `accelerate launch` takes."""

import os

os.environ.setdefault("WANDB_MODE", "offline")  # never ask for a login: wandb logs offline unless told otherwise
