"""Reward-model training on preference pairs (step 1 of RLHF; PPO/GRPO load the result by path).

    python launch/reward.py --config recipes/tiny/reward.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \
        launch/reward.py --config recipes/tiny/reward.yaml
    python launch/reward.py --help        # every key, its default and meaning

Data: JSONL (or JSON/CSV/Parquet) rows {"prompt": ..., "chosen": ..., "rejected": ...}; the reference
CLI's --prompt-text-column / --text-column / --rejected-text-column rename the columns. The model is
written to output_dir (safetensors + reward_config.json): `rl.reward.load_reward_model(output_dir)`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("WANDB_MODE", "offline")

from rl.config import ConfigError, cli_config, save_config, to_dict  # noqa: E402
from rl.data import DataError  # noqa: E402
from rl.launch_utils import dry_run_report, fail, preflight, run_training  # noqa: E402
from rl.model_card import write_model_card  # noqa: E402
from rl.trainers.base import RunError, check_output_dir  # noqa: E402


def main(argv=None) -> None:
    from rl.reward import RewardTrainConfig, load_preference_pairs

    # 1. parse; the data is validated before any model is built, so a bad file fails in seconds
    cfg = cli_config(RewardTrainConfig, argv, prog="launch/reward.py", description=__doc__)
    preflight(cfg)  # model names, deepspeed file, resume path, output_dir: before any model
    d = cfg.data
    if d.path is None:
        fail("data.path is not set: pass --data.path FILE.jsonl or set data: {path: ...} in the recipe")
    try:
        cols = dict(prompt_column=d.prompt_column, chosen_column=d.chosen_column,
                    rejected_column=d.rejected_column, margin_column=cfg.margin_column)
        train = load_preference_pairs(d.path, max_examples=d.max_examples, **cols)
        evals = load_preference_pairs(d.eval_path, **cols) if d.eval_path else None
        model_cfg = cfg.model_config()
        if not cfg.dry_run:
            check_output_dir(cfg)
    except (ConfigError, DataError, RunError) as e:
        fail(str(e))
    if cfg.dry_run:
        dry_run_report(cfg, n_examples=len(train), models={"reward model (trainable)": cfg.model_name})
        return

    # 2. setup
    from rl.forward_backward import build_accelerator
    from rl.models import load_tokenizer, trainable_fraction
    from rl.reward import RewardModel, RewardModelTrainer
    from rl.tracking import Tracker

    import torch

    torch.manual_seed(cfg.seed)
    accelerator = build_accelerator(cfg.gradient_accumulation_steps, micro_batch_size=2 * cfg.batch_size,
                                    max_grad_norm=cfg.max_grad_norm, deepspeed_config=cfg.deepspeed)
    try:
        tokenizer = load_tokenizer(cfg.model_name, cfg.trust_remote_code)
        model = RewardModel(model_cfg, tokenizer=tokenizer)
    except ConfigError as e:  # a packaged model that cannot be fetched (rl.gguf), a hub id offline
        fail(str(e))
    n_train, n_all = trainable_fraction(model)
    trainer = RewardModelTrainer(model, tokenizer, model_cfg, accelerator=accelerator, output_dir=cfg.output_dir)
    tracker = Tracker(cfg.output_dir, cfg.report_to, cfg.run_name, to_dict(cfg), is_main=accelerator.is_main_process,
                      desc="reward", plot_keys=["loss", "accuracy", "margin", "eval/accuracy", "learning_rate"])
    tracker.write(f"reward model: {n_train:,} of {n_all:,} parameters trainable ({100 * n_train / n_all:.2f}%), "
                  f"{len(train)} pairs, {accelerator.num_processes} process(es)")

    # 3. train
    eval_data = ({"chosen": evals.chosen, "rejected": evals.rejected, "prompts": evals.prompts,
                  "margins": evals.margins} if evals is not None else None)
    metrics = run_training(
        trainer, trainer.train_on_preferences, train.chosen, train.rejected, prompts=train.prompts,
        margins=train.margins, num_epochs=cfg.num_epochs, batch_size=cfg.batch_size,
        eval_fraction=0.0 if evals is not None else d.eval_fraction, eval_data=eval_data, tracker=tracker)

    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    out = trainer.save_model(cfg.output_dir)
    if accelerator.is_main_process:
        save_config(cfg, cfg.output_dir, "recipe.yaml")
        write_model_card(out, cfg, trainer.history, "reward")
    if accelerator.is_main_process:
        first = trainer.history[0]["loss"] if trainer.history else float("nan")
        ev = f", eval accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""
        print(f"reward done: loss {first:.4f} -> {metrics.get('loss', float('nan')):.4f}, "
              f"accuracy {metrics.get('accuracy', float('nan')):.3f}{ev} over {trainer.global_step} steps; "
              f"model saved to {out}")


if __name__ == "__main__":
    main()
