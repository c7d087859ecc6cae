"""On-policy distillation (GKD, Agarwal et al. 2024): a student matches a frozen teacher on completions.

The code is `rl/scripts/distill.py` (so that an installed package runs it too: `python -m rl.scripts.distill`,
`rl-train`); this file is the entry point `python launch/distill.py` / `accelerate launch launch/distill.py` takes.
`python launch/distill.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.distill import main  # noqa: E402

if __name__ == "__main__":
    main()
