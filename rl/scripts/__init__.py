"""The launch code of every trainer (`train.py`: one `main(name, argv)` over rl/trainers/registry.py), the
pipeline, chat and eval, inside the package (`python -m rl.scripts.train <name>`, `python -m rl.scripts.<tool>`,
`rl-train`); `launch/<name>.py` are the few-line entry points `accelerate launch` takes."""

import os

os.environ.setdefault("WANDB_MODE", "offline")  # never ask for a login: wandb logs offline unless told otherwise
