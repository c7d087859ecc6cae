"""GRPO / Dr. GRPO / RLOO / REINFORCE++ fine-tuning with reward functions or an environment.

    python launch/grpo.py --config recipes/tiny/grpo.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \\
        launch/grpo.py --config recipes/tiny/grpo.yaml
    python launch/grpo.py --help        # every key, its default and meaning
"""

from __future__ import annotations

import os

from rl.errors import (
    ConfigError,
    DataError,
    RunError,
)
from rl.models.card import write_model_card
from rl.scripts.common import fail, final_save, parse_recipe, run_training
from rl.scripts.dryrun import dry_run_data, dry_run_report
from rl.trainers.base import check_output_dir
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig, grpo_sizes


def main(argv=None) -> None:
    # 1. parse
    cfg = parse_recipe(GRPOConfig, argv, "launch/grpo.py", __doc__)
    try:
        # 2. setup: prompts and reward functions are validated before any model is built
        rows = dry_run_data(cfg, GRPOTrainer.load_data) if cfg.dry_run else GRPOTrainer.load_data(cfg)
        if cfg.dry_run:
            n = len(rows) if rows else None
            dry_run_report(cfg, n_examples=n, models=GRPOTrainer.dry_run_models(cfg),
                           extra=grpo_sizes(cfg, int(os.environ.get("WORLD_SIZE", "1")), n),
                           prompt_group=cfg.num_generations)
            return
        check_output_dir(cfg)
        trainer = GRPOTrainer(cfg, train_prompts=rows)
        plan = trainer.plan()
    except (ConfigError, DataError, RunError, ValueError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(trainer, trainer.train)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    with final_save(cfg.output_dir):  # a full disk: one line, exit 1
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
