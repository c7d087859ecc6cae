"""Held-out accuracy of a model on prompt/answer data, scored by a verifiable reward.

The code is `rl/scripts/eval.py` (so that an installed package runs it too: `python -m rl.scripts.eval`,
`rl-train`); this file is the entry point `python launch/eval.py` / `accelerate launch launch/eval.py` takes.
`python launch/eval.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.engine.dist import run_as_program  # noqa: E402
from rl.scripts.eval import main  # noqa: E402

if __name__ == "__main__":
    run_as_program(main)
