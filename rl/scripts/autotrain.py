"""The reference CLI doc's Python API: `LLMTrainingParams` + `AutoTrainProject(...).create()`.

    from rl import AutoTrainProject, LLMTrainingParams

    params = LLMTrainingParams(model="google/gemma-3-270m", data_path="./prompts.jsonl",
                               project_name="ppo-model", trainer="ppo", rl_reward_model_path="./reward-model",
                               rl_gamma=0.99, rl_kl_coef=0.1, epochs=1, batch_size=4, lr=1e-5)
    AutoTrainProject(params=params, backend="local", process=True).create()

It is `rl-train` from Python: each keyword is the reference flag of the same name (`rl_gamma` ->
`--rl-gamma`), translated to our recipe keys by `rl.scripts.cli.translate` (the same table, `rl.scripts.cli.FLAG_KEYS`),
and `create()` runs the same script, `python -m rl.scripts.train <trainer> <translated arguments>`, in a
subprocess and waits for it. Our own keys pass through (`max_steps=2`, `config="recipes/tiny/sft.yaml"`
as the recipe base, `**{"lora.rank": 8}`). Defaults are our schemas' (`python -m rl.scripts.train <trainer>
--help`), not the reference's: only the keywords given are passed.

Where we differ from the reference, on purpose:
* Mistakes are found when the parameters are built (one-line ValueError/ConfigError naming the key),
  not minutes later in the training process: the translated arguments are parsed by the trainer's schema.
* `backend` is "local" only: the launch scripts run on this machine. Several GPUs or a cluster run
  the same scripts under `accelerate launch` (README) or `launch/slurm/`.
* `process` is accepted either way: our launch scripts always read and validate `data_path`
  themselves (the reference's `process=True` is what they do).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rl.config.parse import parse_config
from rl.scripts.cli import TRAINERS, _schema, command, translate

BACKENDS = ("local",)


def _flag_value(value: Any) -> str:
    """A Python value as the command line spells it: booleans lower case, containers as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return str(value)


def translate_params(trainer: str, params: dict[str, Any], config: str | None = None) -> list[str]:
    """Keyword parameters -> the launch script's arguments, through `rl.scripts.cli.translate` (rl-train's
    table): each keyword is the flag `--<keyword>`; None values are left out. Raises ValueError."""
    argv = [f"--{k}={_flag_value(v)}" for k, v in params.items() if v is not None]
    return ([] if config is None else ["--config", str(config)]) + translate(trainer, argv, _schema(trainer))


class LLMTrainingParams:
    """Training parameters by the reference's names; `.args` is what the launch script receives.

    Args:
        trainer: a registered trainer (sft, reward, dpo, ppo, grpo, ...; "default", the reference's plain LM training, is sft).
        config: optional recipe YAML used as the base (our `--config`).
        **params: reference parameters (`model`, `data_path`, `project_name`, `epochs`, `batch_size`,
            `lr`, `rl_*`, ...) or our own recipe keys; None means "not given" (the schema default).

    Raises ValueError (a `rl.config.fields.ConfigError` for a bad key or value) with a one-line message.
    """

    def __init__(self, trainer: str = "sft", config: str | os.PathLike | None = None, **params: Any):
        trainer = "sft" if trainer == "default" else trainer
        if trainer not in TRAINERS:
            raise ValueError(f"trainer={trainer!r} is unknown; choose one of {', '.join(TRAINERS)}")
        self.trainer = trainer
        self.config = None if config is None else str(config)
        self.params = {k: v for k, v in params.items() if v is not None}
        schema = _schema(trainer)
        try:
            self.args: list[str] = translate_params(trainer, self.params, self.config)
            if schema is not None:
                parse_config(schema, self.args)  # every key and value is checked now, in this process
        except ValueError as e:  # ConfigError included: same type, prefixed with where it came from
            raise type(e)(f"LLMTrainingParams(trainer={trainer!r}): {e}") from None

    def __getattr__(self, name: str) -> Any:
        params = self.__dict__.get("params", {})
        if name in params:
            return params[name]
        raise AttributeError(f"LLMTrainingParams has no parameter {name!r}")

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"LLMTrainingParams(trainer={self.trainer!r}{', config=' + repr(self.config) if self.config else ''}" \
               f"{', ' + given if given else ''})"


class AutoTrainProject:
    """Runs `params` with the trainer's launch script: `create()` blocks until training ends.

    Args:
        params: an `LLMTrainingParams`.
        backend: "local" (the only one; anything else is a ValueError).
        process: accepted for the reference's signature; the launch script always reads the data.
    """

    def __init__(self, params: LLMTrainingParams, backend: str = "local", process: bool = True):
        if not isinstance(params, LLMTrainingParams):
            raise ValueError(f"params must be an LLMTrainingParams, got {type(params).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not supported: only 'local' (this machine runs "
                             f"rl.scripts.train {params.trainer}); for several GPUs or a cluster use "
                             f"`accelerate launch -m rl.scripts.cli ...` or launch/slurm/")
        if not isinstance(process, bool):
            raise ValueError(f"process must be True or False, got {process!r}")
        self.params, self.backend, self.process = params, backend, process

    def command(self) -> list[str]:
        """The command `create()` runs (the same as `rl-train --trainer <trainer> ...` executes)."""
        return command(self.params.trainer, self.params.args)

    def create(self) -> Path | None:
        """Train; returns the project (output) directory when `project_name` was given, else None.

        The launch script's output streams to this process's stdout/stderr; a non-zero exit raises
        RuntimeError naming the exit status (the script has printed its one-line error above)."""
        cmd = self.command()
        sys.stdout.flush()
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            raise RuntimeError(f"{self.params.trainer} training exited with status {rc} (its error is printed "
                               f"above): {' '.join(cmd)}")
        name = self.params.params.get("project_name")
        return None if name is None else Path(str(name))
