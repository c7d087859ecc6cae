"""On-policy distillation (GKD, Agarwal et al. 2024): a student matches a frozen teacher's next-token
distributions (generalised JSD) on the data's completions or, with probability lmbda per step, on its own
samples.

    python launch/distill.py --config recipes/tiny/distill.yaml
    accelerate launch --num_processes 2 launch/distill.py --config recipes/tiny/distill.yaml
    python launch/distill.py --config recipes/tiny/distill.yaml lmbda=1.0 beta=1.0
    python launch/distill.py --help        # every key, its default and meaning

Data: rows {"prompt": ..., "completion": ...} (column names under data.*: prompt_column, completion_column).
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
from rl.trainers.distill import DistillConfig, DistillTrainer


def main(argv=None) -> None:
    # 1. parse
    cfg = parse_recipe(DistillConfig, argv, "launch/distill.py", __doc__, require_data=True)
    try:
        # 2. setup: prompts and completions are validated before any model is built
        if cfg.dry_run:  # the data only when it is here: a plan needs the model's config
            rows = dry_run_data(cfg, DistillTrainer.load_data)
            dry_run_report(cfg, n_examples=None if rows is None else len(rows), models=DistillTrainer.dry_run_models(cfg),
                           prompt_group=1)
            return
        rows = DistillTrainer.load_data(cfg)
        check_output_dir(cfg)
        trainer = DistillTrainer(cfg, train_prompts=rows)
        plan = trainer.plan()
    except (ConfigError, DataError, RunError, ValueError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(trainer, trainer.train)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    with final_save(cfg.output_dir):  # a full disk: one line, exit 1
        out = trainer.save()
        if trainer.accelerator.is_main_process:
            write_model_card(out, cfg, history, "distill")
    if trainer.accelerator.is_main_process:
        rows_ = [r for r in history if "loss" in r]
        msg = f"distill done: {plan['total_steps']} steps"
        if rows_:
            msg += (f"; loss {rows_[0]['loss']:.4f} -> {rows_[-1]['loss']:.4f}, on-policy steps "
                    f"{sum(r['on_policy'] for r in rows_):.0f}/{len(rows_)}")
        print(f"{msg}; model saved to {out}")


if __name__ == "__main__":
    main()
