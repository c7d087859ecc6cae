"""Reward functions the vLLM tier names by `module:function` (the launched processes import them)."""


def spread(prompts, completions, **kw):
    """Distinct completions get distinct rewards, so every group has spread and every step moves the policy."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def record(prompts, completions, **kw):
    """`spread`, and every (prompt, completion) appended to $RL_RECORD_DIR/<pid>.jsonl (the test compares the
    completions of two launches)."""
    import json
    import os

    with open(os.path.join(os.environ["RL_RECORD_DIR"], f"{os.getpid()}.jsonl"), "a") as f:
        for p, c in zip(prompts, completions):
            f.write(json.dumps([p, c]) + "\n")
    return spread(prompts, completions)
