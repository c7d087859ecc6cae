"""PPO for RLHF (step 2 of the reference's pipeline: train a reward model with launch/reward.py, then this).

The code is `rl/scripts/ppo.py` (so that an installed package runs it too: `python -m rl.scripts.ppo`,
`rl-train`); this file is the entry point `python launch/ppo.py` / `accelerate launch launch/ppo.py` takes.
`python launch/ppo.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.ppo import main  # noqa: E402

if __name__ == "__main__":
    main()
