"""The rollout layer: what the online trainers (GRPO, PPO, online DPO) do between a policy and its
rewards: the prompts of a step and their encoding, multi-turn tool-use episodes on top of the sampler
(rl.engine.generation), and greedy held-out evaluation scored by an environment. It may import the
layers below it (rl.envs, rl.rewards, rl.models, rl.data, rl.engine, rl.algos, rl.config) and
rl.errors; it never imports rl.trainers or rl.scripts, which are built on it.
"""
