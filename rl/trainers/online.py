"""What the trainers that sample their own data share (GRPO family, online DPO): the environment and
reward sources, built before the accelerator; where the prompts come from; gathering rollout tensors."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from rl.data.records import has_data
from rl.envs.registry import make_env
from rl.errors import ConfigError
from rl.rollout.prompts import load_prompt_rows
from rl.trainers.base import Trainer
from rl.trainers.rewards import build_reward_fns, env_keys_problem


class OnlineTrainer(Trainer):
    """A trainer whose steps sample completions of prompts from an environment or from data rows."""

    env = eval_env = None
    train_prompts: list[dict] | None = None

    def build_env_rewards(self, reward_funcs: Sequence[Callable] | None, train_prompts: list[dict] | None,
                          missing: str):
        """The environment (and the eval environment), then the reward sources in their fixed order (the
        environment, the reward model, the configured names, the callables); `missing` is the error
        when there is none. Passed to `Trainer.build` as `rewards=`, so it runs before the accelerator."""
        cfg = self.cfg
        try:
            if cfg.env_type:
                self.env = make_env(cfg.env_type, self.tokenizer, dict(cfg.env_config))
                if cfg.eval_env_config is not None:
                    self.eval_env = make_env(cfg.env_type, self.tokenizer, {**cfg.env_config, **cfg.eval_env_config})
        except (ValueError, TypeError) as e:
            raise ConfigError(f"env_type={cfg.env_type}: {e}") from None
        reward = build_reward_fns(cfg, self.tokenizer, reward_funcs=reward_funcs or (), env=self.env, missing=missing)
        if self.env is None and not train_prompts:
            raise ConfigError("no prompts: set env_type or data.path (rows with a 'prompt' column)")
        self.train_prompts = train_prompts
        return reward

    @staticmethod
    def load_data(cfg) -> list[dict] | None:
        """The recipe's prompt rows (data.path), or None when the environment supplies the prompts (a
        data.path beside it would not be read: refused, as every key that would have no effect)."""
        problem = env_keys_problem(cfg, env_supplies_prompts=True)
        if problem:
            raise ConfigError(problem)
        if cfg.env_type is not None:
            return None
        if not has_data(cfg.data):
            raise ConfigError("no prompts: set env_type (e.g. env_type=math), data.path or data.mixture "
                              "(rows with a 'prompt' column)")
        return load_prompt_rows(cfg.data.path, cfg)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`t` of every process, concatenated in process order, on the CPU (one process: `t` itself)."""
        t = t.to(self.accelerator.device)
        return (self.accelerator.gather(t) if self.world > 1 else t).cpu()
