"""GRPO / Dr. GRPO / RLOO / REINFORCE++ fine-tuning with reward functions or an environment.

    python launch/grpo.py --config recipes/tiny/grpo.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \
        launch/grpo.py --config recipes/tiny/grpo.yaml
    python launch/grpo.py --help        # every key, its default and meaning
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("WANDB_MODE", "offline")

from rl.config import ConfigError, cli_config  # noqa: E402
from rl.data import DataError  # noqa: E402
from rl.launch_utils import dry_run_report, fail, preflight, run_training  # noqa: E402
from rl.model_card import write_model_card  # noqa: E402
from rl.trainers.base import RunError, check_output_dir  # noqa: E402


def main(argv=None) -> None:
    from rl.grpo import GRPOConfig, GRPOTrainer, grpo_sizes, load_prompt_rows

    # 1. parse
    cfg = cli_config(GRPOConfig, argv, prog="launch/grpo.py", description=__doc__)
    preflight(cfg)  # model names, deepspeed file, resume path, output_dir: before any model
    if cfg.env_type is None and cfg.data.path is None:
        fail("no prompts: set env_type (e.g. env_type=math) or data.path (rows with a 'prompt' column)")
    try:
        # 2. setup: prompts and reward functions are validated before any model is built
        rows = load_prompt_rows(cfg.data.path, cfg) if cfg.env_type is None else None
        if cfg.dry_run:
            models = {"policy (trainable)": cfg.model_name}
            if cfg.beta > 0:  # beta = 0 loads no reference model
                # LoRA: the reference is the policy with the adapters off (GRPOTrainer loads no copy)
                models["reference (frozen)"] = "policy without adapters" if cfg.lora.enabled else cfg.model_name
            if cfg.reward_model_path:
                models["reward model (frozen)"] = cfg.reward_model_path
            world = int(os.environ.get("WORLD_SIZE", "1"))
            dry_run_report(cfg, n_examples=len(rows) if rows else None, models=models,
                           extra=grpo_sizes(cfg, world, len(rows) if rows else None))
            return
        check_output_dir(cfg)
        trainer = GRPOTrainer(cfg, train_prompts=rows)
        plan = trainer.plan()
    except (ConfigError, DataError, RunError, ValueError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(trainer, trainer.train)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    out = trainer.save()
    if trainer.accelerator.is_main_process:
        write_model_card(out, cfg, history, "grpo")
    if trainer.accelerator.is_main_process:
        train_rows = [r for r in history if "reward" in r]
        evals = [r["eval/accuracy"] for r in history if "eval/accuracy" in r]
        msg = f"grpo done: {plan['total_steps']} steps"
        if train_rows:
            msg += f"; reward {train_rows[0]['reward']:.3f} -> {train_rows[-1]['reward']:.3f}"
        if evals:
            msg += f"; eval accuracy {evals[0]:.3f} -> {evals[-1]:.3f}"
        print(f"{msg}; model saved to {out}")


if __name__ == "__main__":
    main()
