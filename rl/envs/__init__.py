"""The environments layer: where prompts come from and how completions are scored for RL fine-tuning
(text generation, weighted objectives, preference comparison, arithmetic, code with sandboxed unit
tests, multi-turn tool use), the registry behind `make_env`, and the isolated sandbox that runs
generated code. It may import the layers below it (rl.rewards, rl.models, rl.data, rl.engine,
rl.algos, rl.config) and rl.errors; it never imports rl.rollout, rl.trainers or rl.scripts, which are
built on it (`rl.environments` is its public facade).
"""
