"""Multi-turn tool-use episodes as rollouts: `run_episodes` samples B episodes in lockstep and returns an
`EpisodeRollout`, which GRPO and PPO train on as on any `Rollout`.

An episode (the environment is rl.envs.tool_math's ToolMathEnv; the call format rl.envs.tools'):

    prompt            "123*45="
    policy turn 1     "<tool>calculator: 123*45</tool>"       sampled; loss_mask 1; the sampler's log-probs
    tool message      "<result>5535</result>"                 appended by the environment; loss_mask 0
    policy turn 2     "5535</s>"                              sampled; loss_mask 1

Each turn is one `generate` call (rl.engine.generation) over the rows still going, stopping at
`</tool>` or EOS; a call is run with `rl.envs.tools.run_tool` and its tool message appended, except on
the `max_turns`-th turn (nothing could read its result). Every turn calls the sampler, also when no
row is left, so under ZeRO-3 all processes make the same number of collective calls. The token budget
`max_new_tokens` covers the whole episode, tool messages included, so shapes stay those of a one-turn
rollout of that length. Turn t samples with seed `seed + t * 1_000_003`, so a seeded run repeats.

What is masked: tool-message tokens are attended by every later token (attention_mask 1) but are no
actions of the policy: `EpisodeRollout.to_batch` sets their labels to -100, and every GRPO term
(surrogate, k3 KL to the reference, old log-probs, token counts of the aggregation) reads only
positions with labels != -100 (rl.engine.losses.token_logprobs' mask), so they are out of the loss and the
KL exactly as if they were prompt tokens. tests/unit/envs/test_tools.py checks it on the loss function itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from rl.engine.generation import Rollout, generate
from rl.engine.losses import IGNORE_INDEX
from rl.engine.packing import left_pad
from rl.envs.tools import TOOL_CLOSE, parse_tool_call, run_tool

# ------------------------------------------------------------------------------------ the rollout

@dataclass
class EpisodeRollout(Rollout):
    """A `Rollout` whose completion is a whole episode: policy turns and tool messages, right-padded.

    `mask` (B, N) is 1 on every episode token (all are attended), `loss_mask` (B, N) is 1 only on the
    policy's own tokens; `logprobs` are the sampler's on those and 0 on tool tokens."""

    loss_mask: torch.Tensor | None = None  # (B, N) long
    tool_calls: list[int] = field(default_factory=list)  # calls run per row
    turns: list[int] = field(default_factory=list)  # policy turns per row

    def to_batch(self) -> dict[str, torch.Tensor]:
        """As `Rollout.to_batch`, with labels -100 on tool tokens: out of the loss, the KL and the
        token counts, still in the input (attended)."""
        batch = super().to_batch()
        P = self.prompt_ids.shape[1]
        batch["labels"][:, P:] = batch["labels"][:, P:].masked_fill(self.loss_mask == 0, IGNORE_INDEX)
        return batch


@torch.no_grad()
def run_episodes(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, *,
                 env, num_samples: int = 1, generate_fn: Callable = generate, dtype=None) -> EpisodeRollout:
    """Run B = len(prompts) x num_samples episodes in lockstep, one `generate` call per turn over the
    rows still going (exactly max_turns calls, for ZeRO-3's collectives); returns their EpisodeRollout
    (rows prompt-major, as `generate`'s).

    Each turn samples at most the row's remaining budget, stopping at `</tool>` or EOS; a row's turn
    log-probs are those `generate` returned. Turn t uses base seed `seed + t * 1_000_003` (row j of the
    call: + j), so a seeded run repeats exactly. `env` gives max_turns, tools and tool_message (a
    ToolMathEnv); `generate_fn` (generate's signature) is for tests: a scripted policy. `dtype`: generate's."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())
    rows = [list(map(int, p)) for p in prompts for _ in range(num_samples)]
    B = len(rows)
    toks: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    lmask: list[list[int]] = [[] for _ in range(B)]
    reasons, calls, turns = ["length"] * B, [0] * B, [0] * B
    active = list(range(B))
    pad_id, device = None, None
    for turn in range(env.max_turns):
        active = [i for i in active if len(toks[i]) < max_new_tokens]
        # every turn calls the sampler, also with no row left (one throwaway token of row 0): under
        # ZeRO-3 each call gathers the parameters collectively, so all processes must make as many
        contexts = [rows[i] + toks[i] for i in active] or [rows[0]]
        budget = max((max_new_tokens - len(toks[i]) for i in active), default=1)
        out = generate_fn(model, tokenizer, contexts, max_new_tokens=budget, temperature=temperature, top_k=top_k,
                          top_p=top_p, stop_strings=[TOOL_CLOSE], seed=seed + turn * 1_000_003, dtype=dtype)
        pad_id, device = out.pad_token_id, out.prompt_ids.device
        still = []
        for j, i in enumerate(active):
            keep = out.mask[j].bool()
            room = max_new_tokens - len(toks[i])
            new, new_lp = out.tokens[j][keep].tolist()[:room], out.logprobs[j][keep].tolist()[:room]
            toks[i] += new
            lps[i] += new_lp
            lmask[i] += [1] * len(new)
            turns[i] += 1
            truncated = len(new) < int(keep.sum())
            call = parse_tool_call(tokenizer.decode(new, skip_special_tokens=True))
            if truncated or call is None or out.finish_reasons[j] != "stop":
                reasons[i] = "length" if truncated or out.finish_reasons[j] == "length" else "stop"
                continue
            reasons[i] = "stop"
            if turn + 1 == env.max_turns:
                continue  # the last allowed turn: its call is not run
            calls[i] += 1
            result = tokenizer(env.tool_message(run_tool(call, env.tools)), add_special_tokens=False)["input_ids"]
            result = result[:max_new_tokens - len(toks[i])]
            toks[i] += result
            lps[i] += [0.0] * len(result)
            lmask[i] += [0] * len(result)
            if len(toks[i]) < max_new_tokens:
                still.append(i)
            else:
                reasons[i] = "length"
        active = still
    return _pack(rows, toks, lps, lmask, reasons, calls, turns, pad_id, device)


def _pack(rows, toks, lps, lmask, reasons, calls, turns, pad_id: int, device) -> EpisodeRollout:
    """Lists of per-row episode tokens -> right-padded (B, N) tensors and the left-padded prompts."""
    B, N = len(rows), max(1, max(len(t) for t in toks))
    tokens = torch.full((B, N), pad_id, dtype=torch.long)
    logprobs = torch.zeros(B, N, dtype=torch.float32)
    mask = torch.zeros(B, N, dtype=torch.long)
    loss_mask = torch.zeros(B, N, dtype=torch.long)
    for i in range(B):
        n = len(toks[i])
        tokens[i, :n] = torch.tensor(toks[i], dtype=torch.long)
        logprobs[i, :n] = torch.tensor(lps[i], dtype=torch.float32)
        mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(lmask[i], dtype=torch.long)
    prompt_ids, prompt_mask = left_pad(rows, pad_id, device)
    return EpisodeRollout(tokens=tokens.to(device), logprobs=logprobs.to(device), mask=mask.to(device),
                          prompts=rows, prompt_ids=prompt_ids, prompt_mask=prompt_mask, pad_token_id=pad_id,
                          finish_reasons=reasons, loss_mask=loss_mask.to(device), tool_calls=calls, turns=turns)
