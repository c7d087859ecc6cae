"""KTO: preference training on unpaired rows (a completion labelled desirable or not).

The code is `rl/scripts/kto.py` (so that an installed package runs it too: `python -m rl.scripts.kto`,
`rl-train`); this file is the entry point `python launch/kto.py` / `accelerate launch launch/kto.py` takes.
`python launch/kto.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.scripts.kto import main  # noqa: E402

if __name__ == "__main__":
    main()
