"""The rewards layer: verifiable rewards computed from the text of a completion: answer extraction and
exact comparison (with Hugging Face's math-verify, in a child process, for LaTeX), and the named
reward functions of the CLI and recipes, all in the trainers' batched signature. It may import the
layers below it (rl.models, rl.data, rl.engine, rl.algos, rl.config) and rl.errors, and needs none of
them today; it never imports rl.envs or anything above, which score with it.
"""
