"""PPO for RLHF (step 2 of the reference's pipeline: train a reward model with launch/reward.py, then this).

    python launch/ppo.py --config recipes/tiny/ppo.yaml
    accelerate launch launch/ppo.py --config recipes/gemma.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \
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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("WANDB_MODE", "offline")

from rl.config import ConfigError, cli_config  # noqa: E402
from rl.data import DataError  # noqa: E402
from rl.launch_utils import dry_run_report, fail, preflight, run_training  # noqa: E402
from rl.model_card import write_model_card  # noqa: E402
from rl.trainers.base import RunError, check_output_dir  # noqa: E402


def load_prompts(path: str, cfg) -> tuple[list[str], list[dict]]:
    """Prompt strings and, per prompt, the row's other columns as metadata."""
    from rl.data import load_records, read_records

    d = cfg.data
    load_records(path, columns=[d.text_column], max_examples=d.max_examples)  # validates, names file:line
    rows = read_records(path)[:d.max_examples] if d.max_examples else read_records(path)
    return ([r[d.text_column] for r in rows],
            [{k: v for k, v in r.items() if k not in (d.text_column, "_line")} for r in rows])


def main(argv=None) -> None:
    from rl.ppo import PPOConfig, check_reward_source

    # 1. parse; reward source and data are checked before any model is built
    cfg = cli_config(PPOConfig, argv, prog="launch/ppo.py", description=__doc__)
    preflight(cfg)  # model names, deepspeed file, resume path, output_dir: before any model
    try:
        check_reward_source(cfg)
        if cfg.data.path is None and not (cfg.env_type or cfg.multi_objective):
            raise ConfigError("data.path is not set: pass --data.path prompts.jsonl (rows {\"text\": ...}) "
                              "or set data: {path: ...} in the recipe")
        prompts, metadata = load_prompts(cfg.data.path, cfg) if cfg.data.path else (None, None)
        eval_prompts = load_prompts(cfg.data.eval_path, cfg)[0] if cfg.data.eval_path else None
        if cfg.dry_run:
            from rl.ppo import ppo_plan

            models = {"policy (trainable)": cfg.model_name,
                      "reference (frozen)": cfg.ref_model or ("policy without adapters" if cfg.lora.enabled
                                                              else cfg.model_name),
                      "reward model (frozen)": cfg.reward_model_path or cfg.reward_fn or f"env:{cfg.env_type or 'multi_objective'}"}
            if cfg.value_model == "critic":
                models["value (trainable)"] = {"name": cfg.critic_model_path or cfg.reward_model_path or cfg.model_name,
                                               "trainable": True, "task": "classifier"}
            plan = ppo_plan(cfg, len(prompts) if prompts else None, int(os.environ.get("WORLD_SIZE", "1")))
            dry_run_report(cfg, n_examples=len(prompts) if prompts else None, models=models, extra=plan)
            return
        # 2. setup
        from rl.ppo import PPOTrainer

        check_output_dir(cfg)
        trainer = PPOTrainer(cfg)
        if prompts is None:  # the environment supplies the prompts
            env = trainer.reward.env
            prompts, metadata = list(env.prompts), list(env.metadata)
    except (ConfigError, DataError, FileNotFoundError, RunError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(trainer, trainer.train, prompts, metadata=metadata, eval_prompts=eval_prompts)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    out = trainer.save()
    if trainer.accelerator.is_main_process:
        write_model_card(out, cfg, history, "ppo")
    if trainer.accelerator.is_main_process and history:
        first, last = history[0], history[-1]
        print(f"ppo done: objective/scores {first['objective/scores']:.4f} -> {last['objective/scores']:.4f}, "
              f"objective/kl {last['objective/kl']:.4f}, kl_coef {last['kl_coef']:.4f} over {len(history)} "
              f"iterations; seconds per iteration: generation {last['time/generation']:.2f}, scoring "
              f"{last['time/scoring']:.2f}, training {last['time/training']:.2f}; model saved to {out}")


if __name__ == "__main__":
    main()
