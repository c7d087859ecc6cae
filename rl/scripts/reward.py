"""Reward-model training on preference pairs (step 1 of RLHF; PPO/GRPO load the result by path).

    python launch/reward.py --config recipes/tiny/reward.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \\
        launch/reward.py --config recipes/tiny/reward.yaml
    python launch/reward.py --help        # every key, its default and meaning

Data: JSONL (or JSON/CSV/Parquet) rows {"prompt": ..., "chosen": ..., "rejected": ...}; the reference
CLI's --prompt-text-column / --text-column / --rejected-text-column rename the columns. The model is
written to output_dir (safetensors + reward_config.json): `rl.models.reward.load_reward_model(output_dir)`.
"""

from __future__ import annotations

from rl.config.parse import save_config
from rl.errors import (
    ConfigError,
    DataError,
    RunError,
)
from rl.models.card import write_model_card
from rl.scripts.common import fail, final_save, parse_recipe, run_training
from rl.scripts.dryrun import dry_run_data, dry_run_report
from rl.trainers.base import check_output_dir
from rl.trainers.reward import RewardModelTrainer
from rl.trainers.reward_config import RewardTrainConfig


def main(argv=None) -> None:
    # 1. parse; the data is validated before any model is built, so a bad file fails in seconds
    cfg = parse_recipe(RewardTrainConfig, argv, "launch/reward.py", __doc__, require_data=True)
    try:
        if cfg.dry_run:  # the data only when it is here: a plan needs the model's config
            data = dry_run_data(cfg, RewardModelTrainer.load_data)
            dry_run_report(cfg, n_examples=None if data is None else len(data[0]),
                           models=RewardModelTrainer.dry_run_models(cfg))
            return
        train, evals = RewardModelTrainer.load_data(cfg)  # the model settings were checked when cfg was built
        check_output_dir(cfg)
    except (ConfigError, DataError, RunError) as e:
        fail(str(e))

    # 2. setup
    try:
        trainer = RewardModelTrainer.from_recipe(cfg)
    except ConfigError as e:  # a packaged model that cannot be fetched (rl.models.gguf), a hub id offline
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    metrics = run_training(trainer, trainer.train_recipe, cfg, train, evals)

    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    with final_save(cfg.output_dir):  # a full disk: one line, exit 1
        out = trainer.save_model(cfg.output_dir)
        if trainer.accelerator.is_main_process:
            save_config(cfg, cfg.output_dir, "recipe.yaml")
            write_model_card(out, cfg, trainer.history, "reward")
    if trainer.accelerator.is_main_process:
        first = trainer.history[0]["loss"] if trainer.history else float("nan")
        ev = f", eval accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""
        print(f"reward done: loss {first:.4f} -> {metrics.get('loss', float('nan')):.4f}, "
              f"accuracy {metrics.get('accuracy', float('nan')):.3f}{ev} over {trainer.current_step} steps; "
              f"model saved to {out}")


if __name__ == "__main__":
    main()
