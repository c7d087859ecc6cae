"""DPO-family preference training (DPO, conservative DPO, IPO, hinge, reference-free, ORPO).

The code is `rl/scripts/dpo.py` (so that an installed package runs it too: `python -m rl.scripts.dpo`,
`rl-train`); this file is the entry point `python launch/dpo.py` / `accelerate launch launch/dpo.py` takes.
`python launch/dpo.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.dpo import main  # noqa: E402

if __name__ == "__main__":
    main()
