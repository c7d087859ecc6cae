"""Online DPO (Guo et al. 2024): two samples per prompt, ranked by reward functions, a reward model or an
environment, and a DPO / IPO / hinge step on each fresh pair against the frozen reference.

    python launch/online_dpo.py --config recipes/tiny/online_dpo.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \\
        launch/online_dpo.py --config recipes/tiny/online_dpo.yaml
    python launch/online_dpo.py --help        # every key, its default and meaning
"""

from __future__ import annotations

from rl.errors import (
    ConfigError,
    DataError,
    RunError,
)
from rl.models.card import write_model_card
from rl.scripts.common import fail, final_save, parse_recipe, run_training
from rl.scripts.dryrun import dry_run_data, dry_run_report
from rl.trainers.base import check_output_dir
from rl.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer


def main(argv=None) -> None:
    # 1. parse
    cfg = parse_recipe(OnlineDPOConfig, argv, "launch/online_dpo.py", __doc__)
    try:
        # 2. setup: prompts and reward functions are validated before any model is built
        rows = dry_run_data(cfg, OnlineDPOTrainer.load_data) if cfg.dry_run else OnlineDPOTrainer.load_data(cfg)
        if cfg.dry_run:
            dry_run_report(cfg, n_examples=len(rows) if rows else None, models=OnlineDPOTrainer.dry_run_models(cfg),
                           prompt_group=1)
            return
        check_output_dir(cfg)
        trainer = OnlineDPOTrainer(cfg, train_prompts=rows)
        plan = trainer.plan()
    except (ConfigError, DataError, RunError, ValueError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(trainer, trainer.train)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    with final_save(cfg.output_dir):  # a full disk: one line, exit 1
        out = trainer.save()
        if trainer.accelerator.is_main_process:
            write_model_card(out, cfg, history, "online_dpo")
    if trainer.accelerator.is_main_process:
        train_rows = [r for r in history if "objective/scores" in r]
        evals = [r["eval/accuracy"] for r in history if "eval/accuracy" in r]
        msg = f"online_dpo done: {plan['total_steps']} steps"
        if train_rows:
            msg += (f"; scores {train_rows[0]['objective/scores']:.3f} -> {train_rows[-1]['objective/scores']:.3f}"
                    f", ties {sum(r['online_dpo/ties'] for r in train_rows) / len(train_rows):.2f}")
        if evals:
            msg += f"; eval accuracy {evals[0]:.3f} -> {evals[-1]:.3f}"
        print(f"{msg}; model saved to {out}")


if __name__ == "__main__":
    main()
