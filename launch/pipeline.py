"""The README's main job: build a model, SFT it on arithmetic, measure held-out exact-match accuracy,

The code is `rl/scripts/pipeline.py` (so that an installed package runs it too: `python -m rl.scripts.pipeline`,
`rl-train`); this file is the entry point `python launch/pipeline.py` / `accelerate launch launch/pipeline.py` takes.
`python launch/pipeline.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.engine.dist import run_as_program  # noqa: E402
from rl.scripts.pipeline import main  # noqa: E402

if __name__ == "__main__":
    run_as_program(main)
