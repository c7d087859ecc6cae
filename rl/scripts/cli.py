"""`rl-train`: one command for users of the reference's CLI (`aitraining llm --train ...`).

    rl-train --trainer dpo --model google/gemma-2-2b --data-path pairs.jsonl --dpo-beta 0.1
    rl-train grpo --config trl_recipe.yaml       # the trainer first, as `trl grpo --config` (a TRL recipe runs as is)
    rl-train --trainer ppo --model google/gemma-3-270m --data-path prompts.jsonl \\
        --project-name ppo-model --rl-reward-model-path ./reward-model --rl-kl-coef 0.1
    accelerate launch --num_processes 8 -m rl.scripts.cli --trainer sft --config recipes/qwen/0.5b_sft.yaml

The reference's flags are translated to our recipe keys (the table is `FLAG_KEYS` below and in
the README, "For users of the reference CLI"); every other argument (`--config recipe.yaml`, `--max_steps 10`, `lora.rank=8`,
`--dry-run`) passes through unchanged. The trainer's launch code (`python -m rl.scripts.train <trainer>`, the code of `launch/<trainer>.py`) then replaces this process
(`exec` with the same Python), so under `accelerate launch` each rank keeps its RANK/WORLD_SIZE
environment, its PID and therefore its Slurm signals.
"""

from __future__ import annotations

import os
import sys

from rl.config.parse import field_type
from rl.rollout.vllm_server import main as serve_main
from rl.trainers.registry import TRAINERS, resolve

# reference flag (dashes as underscores) -> our recipe key; a tuple lists candidates, the first key the
# trainer's schema knows wins; a dict depends on the trainer.
FLAG_KEYS: dict[str, object] = {
    "model": "model_name",
    "data_path": "data.path",
    "project_name": "output_dir",
    "lr": "learning_rate",
    "epochs": "num_train_epochs",
    "batch_size": "per_device_train_batch_size",
    "prompt_text_column": "data.prompt_column",
    # In the reference, --text-column is the text for SFT and the prompts for PPO, but the chosen answer
    # for reward and DPO pairs (with --rejected-text-column as the other one).
    "text_column": {e.name: e.text_column for e in TRAINERS.values() if e.text_column},
    "rejected_text_column": "data.rejected_column",
    "dpo_beta": "beta",
    "model_ref": ("ref_model",),
    "reward_model": ("reward_model_path",),  # the module docs' spelling of --rl-reward-model-path
    # the CLI doc's PPO memory knobs: positions per LM-head + log-softmax chunk when scoring, and
    # freeing the device's cached memory between generation and training
    "rl_chunk_size": ("logprob_chunk_size",),
    "rl_optimize_device_cache": ("optimize_device_cache",),
}

# Accepted and ignored: `aitraining llm --train ...` pasted as is.
IGNORED = {"llm", "--train"}


def _schema(trainer: str):
    try:
        return resolve(TRAINERS[trainer].config)
    except (ImportError, AttributeError):
        return None  # the launch script will report what is missing


def _knows(schema, key: str) -> bool:
    return schema is None or field_type(schema, key) is not None


def translate(trainer: str, argv: list[str], schema=None) -> list[str]:
    """The reference's flags in `argv` -> our `--key value` overrides; other arguments unchanged.

    Raises ValueError (one line) for a reference flag the trainer has no key for."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in IGNORED:
            continue
        if not arg.startswith("--"):
            out.append(arg)
            continue
        flag, eq, value = arg[2:].partition("=")
        flag = flag.replace("-", "_")
        if flag not in FLAG_KEYS and not flag.startswith("rl_"):
            out.append(arg)  # one of our own keys (or --config): the launch script parses it
            if not eq and i < len(argv) and not argv[i].startswith("--") and "=" not in argv[i]:
                out.append(argv[i])
                i += 1
            continue
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                value = argv[i]
                i += 1
            else:
                value = "true"  # a bare boolean flag such as --rl-multi-objective
        out += [f"--{_target(trainer, flag, schema)}", value]
    return out


def _target(trainer: str, flag: str, schema) -> str:
    spec = FLAG_KEYS.get(flag)
    if isinstance(spec, dict):
        spec = spec.get(trainer, ())  # no key of this trainer's: the error below
    if spec is None:  # --rl-<name>: the schema's alias rl_<name> (e.g. rl_kl_coef), else <name>
        spec = (flag, flag[3:])
    candidates = (spec,) if isinstance(spec, str) else spec
    if not candidates:
        raise ValueError(f"--{flag.replace('_', '-')} has no meaning for --trainer {trainer}; drop it or pick "
                         f"another trainer")
    for key in candidates:
        if _knows(schema, key):
            return key
    raise ValueError(f"--{flag.replace('_', '-')} has no meaning for --trainer {trainer} "
                     f"(no key {' or '.join(candidates)} in its schema); drop it or pick another trainer")


def command(trainer: str, args: list[str]) -> list[str]:
    """The process that trains: the launch code of this package (rl.scripts.train), so that an installed
    wheel trains from any directory (`launch/<name>.py` calls the same `main`)."""
    return [sys.executable, "-m", "rl.scripts.train", trainer, *args]


def _targets(keys) -> str:
    """A flag's recipe key as --help shows it: one key, the first key of the trainer's schema among several, or
    the key per trainer."""
    if isinstance(keys, str):
        return keys
    if isinstance(keys, dict):
        by_key: dict[str, list[str]] = {}
        for trainer, key in keys.items():
            by_key.setdefault(key, []).append(trainer)
        return "; ".join(f"{key} ({', '.join(ts)})" for key, ts in by_key.items())
    return " or ".join(keys)


def usage() -> str:
    rows = "\n".join(f"  --{k.replace('_', '-'):<24} {_targets(v)}" for k, v in FLAG_KEYS.items())
    trainers = f"{{{','.join(TRAINERS)}}}"
    return (f"usage: rl-train --trainer {trainers} [reference flags] [--config RECIPE] [key=value ...]\n"
            f"       rl-train {trainers} --config RECIPE [key=value ...]   (the trainer first, as trl grpo --config)\n\n"
            f"{__doc__.strip()}\n\nreference flag -> recipe key:\n{rows}\n"
            f"  --rl-<name>                -> the trainer's rl_<name> alias, else <name>\n\n"
            f"Each trainer lists its own keys: rl-train --trainer ppo --help\n")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    trainer, rest = None, []
    if argv and argv[0] in TRAINERS:  # `rl-train grpo --config recipe.yaml`, as `trl grpo --config recipe.yaml`
        trainer, argv = argv[0], argv[1:]
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--trainer" and i + 1 < len(argv):
            trainer, i = argv[i + 1], i + 2
            continue
        if a.startswith("--trainer="):
            trainer = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if trainer is None:
        if any(a in ("-h", "--help") for a in rest):
            print(usage())
            raise SystemExit(0)
        print(f"error: --trainer is required: one of {', '.join(TRAINERS)}", file=sys.stderr)
        raise SystemExit(2)
    if trainer not in TRAINERS:
        print(f"error: --trainer {trainer!r} is unknown; choose one of {', '.join(TRAINERS)}", file=sys.stderr)
        raise SystemExit(2)
    try:
        args = translate(trainer, rest, _schema(trainer))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if os.environ.get("RL_TRAIN_PRINT_ONLY"):  # for tests and for seeing what would run
        print(" ".join(command(trainer, args)))
        return
    sys.stdout.flush()
    os.execv(sys.executable, command(trainer, args))


RL_COMMANDS = {"train": "rl-train's options (--trainer NAME ...)", "vllm-serve": "a vLLM server for use_vllm=true "
               "vllm_mode=server (rl.rollout.vllm_server; like `trl vllm-serve`)"}


def rl_main(argv=None) -> None:
    """`rl <command> ...`: `rl train` (= rl-train) and `rl vllm-serve`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in RL_COMMANDS:
        lines = "\n".join(f"  rl {k:<11} {v}" for k, v in RL_COMMANDS.items())
        print(f"usage: rl <command> [options]\n{lines}", file=sys.stderr if argv and argv[0] not in ("-h", "--help")
              else sys.stdout)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if argv[0] == "vllm-serve":
        return serve_main(argv[1:])
    return main(argv[1:])


if __name__ == "__main__":
    main()
