"""Held-out evaluation for GRPO and online DPO: greedy completions of an environment's fixed prompts
(`unique_eval_set`: without repeats), scored by the environment (`greedy_eval`); multi-turn
environments are evaluated on whole episodes (rl.rollout.episodes).
"""

from __future__ import annotations

from functools import partial

import torch

from rl.engine.generation import generate
from rl.rollout.episodes import run_episodes
from rl.rollout.prompts import encode_prompt


@torch.no_grad()
def greedy_eval(model, tokenizer, env, prompts: list[str], metadata: list[dict], max_new_tokens: int,
                prompt_budget: int = 512, batch_size: int = 64, chat: bool = False) -> dict:
    """Greedy completions scored by `env`: eval/accuracy (mean correctness component when the env has
    one, else the fraction of rewards > 0), eval/reward, eval/mean_length (and eval/tool_call_rate for a
    multi-turn environment, whose episodes rl.rollout.episodes.run_episodes runs). Every rank must call it
    under ZeRO-3 (generation gathers the parameters)."""
    rewards, correct, lengths, tool_use = [], [], [], []
    sample = partial(run_episodes, env=env) if getattr(env, "multi_turn", False) else generate
    for i in range(0, len(prompts), batch_size):
        ps, ms = prompts[i:i + batch_size], metadata[i:i + batch_size]
        ids = [encode_prompt(tokenizer, p, prompt_budget, chat) for p in ps]
        out = sample(model, tokenizer, ids, max_new_tokens=max_new_tokens, temperature=0.0)
        texts = tokenizer.batch_decode(out.completions(), skip_special_tokens=True)
        r, m = env.score(ps, texts, ms)
        rewards += r
        correct += m.get("reward_correctness", [1.0 if x > 0 else 0.0 for x in r])
        tool_use += m.get("reward_tool_use", [])
        lengths += out.lengths.tolist()
    n = max(len(rewards), 1)
    return {"eval/accuracy": sum(correct) / n, "eval/reward": sum(rewards) / n,
            "eval/mean_length": sum(lengths) / n, "eval/num_prompts": len(rewards),
            **({"eval/tool_call_rate": sum(tool_use) / n} if tool_use else {})}


def unique_eval_set(env, limit: int) -> tuple[list[str], list[dict]]:
    """The environment's fixed prompts without duplicates (generated test splits repeat problems)."""
    seen, prompts, metas = set(), [], []
    for p, m in zip(env.prompts, env.metadata):
        if p not in seen:
            seen.add(p)
            prompts.append(p)
            metas.append(m)
        if len(prompts) >= limit:
            break
    return prompts, metas
