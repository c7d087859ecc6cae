"""Which engine a trainer samples with: our sampler (`rl.engine.generation.generate`, the default and the
reference) or, with `use_vllm=true`, vLLM (`rl.rollout.vllm_engine`) holding the policy's current weights."""

from __future__ import annotations

from functools import partial

from rl.engine.dist import unwrap_module
from rl.models.sources import resolve_model_path
from rl.rollout.vllm_engine import VLLMRollout


def rollout_sampler(trainer, ours):
    """A function with `generate`'s signature for the trainer's next rollout: `ours` (our sampler, the
    trainer module's `generate`) unless use_vllm=true. With vLLM the engine is
    built at the first call (every process: colocated engines, or the server's client) and its weights
    are synced whenever the policy took an optimizer step since the last rollout."""
    cfg = trainer.cfg
    if not getattr(cfg, "use_vllm", False):
        return ours
    engine = getattr(trainer, "_vllm", None)
    pipe = trainer.pipeline  # PPO samples its first rollout before its pipeline exists: the policy itself
    policy = pipe.model if pipe is not None else trainer.policy
    if engine is None:
        config = getattr(unwrap_module(policy), "config", None)
        engine = trainer._vllm = VLLMRollout(cfg, trainer.accelerator, resolve_model_path(cfg.model_name), config)
    return engine.sampler(policy, pipe.step if pipe is not None else 0)


def episode_sampler(trainer, ours, episodes, env):
    """`rollout_sampler`'s function, or for a multi-turn environment (rl.envs.tool_math) `episodes`
    (`run_episodes`, the trainer module's: tests patch it there) running whole episodes on it."""
    gen = rollout_sampler(trainer, ours)
    if not getattr(env, "multi_turn", False):
        return gen
    return partial(episodes, env=env, **({} if gen is ours else {"generate_fn": gen}))
