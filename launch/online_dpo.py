"""Online DPO (Guo et al. 2024): two samples per prompt, ranked by reward functions, a reward model or an

The code is `rl/scripts/online_dpo.py` (so that an installed package runs it too: `python -m rl.scripts.online_dpo`,
`rl-train`); this file is the entry point `python launch/online_dpo.py` / `accelerate launch launch/online_dpo.py` takes.
`python launch/online_dpo.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.online_dpo import main  # noqa: E402

if __name__ == "__main__":
    main()
