"""Talk to a model: any run's output directory (full model or PEFT adapter), a hub id or tiny:llama.

The code is `rl/scripts/chat.py` (so that an installed package runs it too: `python -m rl.scripts.chat`,
`rl-train`); this file is the entry point `python launch/chat.py` / `accelerate launch launch/chat.py` takes.
`python launch/chat.py --help` lists every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rl.engine.dist import run_as_program  # noqa: E402
from rl.scripts.chat import main  # noqa: E402

if __name__ == "__main__":
    run_as_program(main)
