"""Supervised fine-tuning.

The code is `rl/scripts/sft.py` (so that an installed package runs it too: `python -m rl.scripts.sft`,
`rl-train`); this file is the entry point `python launch/sft.py` / `accelerate launch launch/sft.py` takes.
`python launch/sft.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.sft import main  # noqa: E402

if __name__ == "__main__":
    main()
