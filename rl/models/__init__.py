"""The models layer: everything that builds, loads, wraps or writes a model: names resolved to loadable
directories (hub id, path, `tiny:<family>`, `.gguf`, packaged names), causal LMs and classifiers with
dtype, LoRA, 4-bit and gradient checkpointing, PPO's value head and critic, reward models and their
file format, the frozen reference policy, saving final outputs, and the model card. It may import the
layers below it (rl.data, rl.engine, rl.algos, rl.config) and rl.errors; it never imports rl.rewards,
rl.envs or anything above, which load their models through it.
"""
