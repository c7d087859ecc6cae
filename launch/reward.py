"""Reward-model training on preference pairs (step 1 of RLHF; PPO/GRPO load the result by path).

The code is `rl/scripts/reward.py` (so that an installed package runs it too: `python -m rl.scripts.reward`,
`rl-train`); this file is the entry point `python launch/reward.py` / `accelerate launch launch/reward.py` takes.
`python launch/reward.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.reward import main  # noqa: E402

if __name__ == "__main__":
    main()
