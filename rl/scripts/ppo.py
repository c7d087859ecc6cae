"""PPO for RLHF (step 2 of the reference's pipeline: train a reward model with launch/reward.py, then this).

    python launch/ppo.py --config recipes/tiny/ppo.yaml
    accelerate launch launch/ppo.py --config recipes/gemma.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \\
        launch/ppo.py --config recipes/tiny/ppo.yaml
    python launch/ppo.py --help        # every key, its default and meaning (rl_* names are aliases)

Data: prompts only, JSONL (or JSON/CSV/Parquet) rows {"text": "..."} (data.text_column); other columns
(e.g. "answer") are passed to the reward as metadata. Reward: reward_model_path (--rl-reward-model-path),
reward_fn (--rl-reward-fn default|length_penalty|correctness|custom) or an environment (--rl-env-type,
--rl-env-config); several combine when reward_weights (--rl-reward-weights) is given. A reward source on
the command line replaces the recipe's. With only ref_model (--model-ref) reward_fn=default is used; with
none the run stops at once. An environment may also supply the prompts when data.path is not set.
"""

from __future__ import annotations

import os
from pathlib import Path

from rl.errors import (
    ConfigError,
    DataError,
    RunError,
)
from rl.models.card import write_model_card
from rl.scripts.common import fail, final_save, parse_recipe, run_training
from rl.scripts.dryrun import dry_run_data, dry_run_report
from rl.trainers.base import check_output_dir
from rl.trainers.ppo import PPOTrainer
from rl.trainers.ppo_config import PPOConfig, check_reward_source, ppo_plan


def main(argv=None) -> None:
    # 1. parse; reward source and data are checked before any model is built
    cfg = parse_recipe(PPOConfig, argv, "launch/ppo.py", __doc__)
    try:
        if not (cfg.dry_run and cfg.reward_model_path and not Path(cfg.reward_model_path).exists()):
            check_reward_source(cfg)  # a dry run plans without the reward model that an earlier step writes
        if cfg.dry_run:  # the data only when it is here: a plan needs the model's config
            data = dry_run_data(cfg, PPOTrainer.load_data)
            n = len(data[0]) if data and data[0] else None
            plan = ppo_plan(cfg, n, int(os.environ.get("WORLD_SIZE", "1")))
            dry_run_report(cfg, n_examples=n, models=PPOTrainer.dry_run_models(cfg), extra=plan)
            return
        prompts, metadata, eval_prompts, eval_metadata = PPOTrainer.load_data(cfg)
        # 2. setup
        check_output_dir(cfg)
        trainer = PPOTrainer(cfg)
    except (ConfigError, DataError, FileNotFoundError, RunError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint; without data.path the environment
    # supplies the prompts)
    history = run_training(trainer, trainer.train, prompts, metadata=metadata, eval_prompts=eval_prompts,
                           eval_metadata=eval_metadata)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    with final_save(cfg.output_dir):  # a full disk: one line, exit 1
        out = trainer.save()
        if trainer.accelerator.is_main_process:
            write_model_card(out, cfg, history, "ppo")
    if trainer.accelerator.is_main_process and history:
        first, last = history[0], history[-1]
        print(f"ppo done: objective/scores {first['objective/scores']:.4f} -> {last['objective/scores']:.4f}, "
              f"objective/kl {last['objective/kl']:.4f}, kl_coef {last['kl_coef']:.4f} over {last['iteration']} "
              f"iterations ({len(history)} optimizer steps); seconds: generation {last['time/generation']:.2f} and "
              f"scoring {last['time/scoring']:.2f} per iteration, training {last['time/training']:.2f} per step; "
              f"model saved to {out}")


if __name__ == "__main__":
    main()
