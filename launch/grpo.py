"""GRPO / Dr. GRPO / RLOO / REINFORCE++ fine-tuning with reward functions or an environment.

The code is `rl/scripts/grpo.py` (so that an installed package runs it too: `python -m rl.scripts.grpo`,
`rl-train`); this file is the entry point `python launch/grpo.py` / `accelerate launch launch/grpo.py` takes.
`python launch/grpo.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.grpo import main  # noqa: E402

if __name__ == "__main__":
    main()
