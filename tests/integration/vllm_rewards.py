"""Reward functions the vLLM tier names by `module:function` (the launched processes import them)."""


def spread(prompts, completions, **kw):
    """Distinct completions get distinct rewards, so every group has spread and every step moves the policy."""
    return [float(sum(map(ord, c)) % 7) for c in completions]
