"""The entry point `python launch/<name>.py` / `accelerate launch launch/<name>.py` of the trainer registered
under this file's name in rl/trainers/registry.py (every trainer's launcher is this same file). The code is
rl/scripts/train.py, so that an installed package runs it too: `python -m rl.scripts.train <name>`,
`rl-train --trainer <name>`. `python launch/<name>.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.engine.dist import run_as_program  # noqa: E402
from rl.scripts.train import main  # noqa: E402

if __name__ == "__main__":
    run_as_program(main, Path(__file__).stem)
