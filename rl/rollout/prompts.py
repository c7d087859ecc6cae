"""The prompts of an online trainer's step: prompt rows from a data file or an environment, the same on
every process, and their encoding.

`encode_prompt` tokenises one prompt as the SFT trainer does (BOS once, then the prompt, optionally
rendered as a chat user turn with the assistant header after it), keeping the last `budget` tokens.
`load_prompt_rows` reads a data file's prompt column (data.prompt_column, else data.text_column) and
keeps the other columns as keyword columns for the reward functions (TRL's convention).
`step_prompts` picks a step's n rows: from the environment, seeded by the generation index, or from the
data rows, one pass over a seeded permutation per epoch. Every process computes the same rows and
takes its own share. A dynamic-sampling round after the first (DAPO, Yu et al. 2025, sec. 3.2; the
rounds are assembled in rl.trainers.grpo_batch) draws n more at random, from a seed stream of its own
(far from every first round's seed).
"""

from __future__ import annotations

import torch

from rl.data.chat import render_chat, with_bos
from rl.data.columns import missing_column
from rl.data.records import read_records, source_name, source_options, where
from rl.errors import DataError
from rl.rewards.functions import reward_columns_problem


def encode_prompt(tokenizer, prompt: str | list[dict], budget: int | None = None, chat: bool = False) -> list[int]:
    """Token ids of one prompt, as every trainer, chat and eval build them: BOS exactly once, then the
    prompt (with `chat`, rendered as a user turn followed by the assistant's header; a list of
    {"role", "content"} messages is always rendered with the chat template). A prompt over `budget`
    tokens keeps its BOS and its last tokens (left truncation: the question's end, next to where the
    answer starts, is what the model needs)."""
    if isinstance(prompt, list):
        prompt = render_chat(tokenizer, prompt, add_generation_prompt=True)
    elif chat:
        prompt = render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = with_bos(tokenizer, tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return keep_last(ids, budget, getattr(tokenizer, "bos_token_id", None))


def keep_last(ids: list[int], budget: int | None, bos: int | None) -> list[int]:
    """`ids` cut to `budget` tokens from the left (None: uncut), keeping a leading BOS."""
    if budget is None or len(ids) <= budget:
        return ids
    head = ids[:1] if bos is not None and ids[:1] == [bos] else []
    return head + ids[len(ids) - budget + len(head):]


def prompt_order(step: int, n: int, per_step: int, seed: int) -> list[int]:
    """The step's `per_step` indices out of n prompt rows: consecutive slices of per-epoch seeded
    shuffles (every row once per epoch; a step that crosses an epoch's end continues into the next
    shuffle), identical on every process and a function of the step alone (resume-exact)."""
    out, pos = [], step * per_step
    while len(out) < per_step:
        epoch, offset = divmod(pos, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        take = order[offset:offset + per_step - len(out)]
        out += take
        pos += len(take)
    return out


def load_prompt_rows(path: str, cfg) -> list[dict]:
    """Rows of a data file with a prompt column (data.prompt_column, else data.text_column); the other
    columns are passed to the reward functions as keyword arguments (TRL's convention), so each column a
    configured reward function reads (`rl.rewards.functions.needs`) must be there: checked here, before any model.
    With `system_prompt` each prompt is a chat (the system message, then the prompt as the user's), as TRL's
    conversational prompts."""
    rows = read_records(path, **source_options(cfg.data, seed=cfg.seed))
    if cfg.data.max_examples:
        rows = rows[:cfg.data.max_examples]
    if not rows:
        raise DataError(f"{source_name(path)}: no rows")
    present = {k for r in rows[:1000] for k in r if k != "_line"}
    col = next((c for c in (cfg.data.prompt_column, cfg.data.text_column) if c in present), None)
    if col is None:
        raise missing_column(where(path, rows[0]), cfg.data.prompt_column, present, "data.prompt_column")
    system = getattr(cfg, "system_prompt", None)
    out = []
    for row in rows:
        p = row.get(col)
        if not isinstance(p, str) or not p:
            raise DataError(f"{where(path, row)}: column '{col}' must be a non-empty string "
                            f"(set data.prompt_column to the prompt column)")
        if system:  # a chat prompt, as open-r1 builds it: the system message, then the row's prompt as the user's
            p = [{"role": "system", "content": system}, {"role": "user", "content": p}]
        out.append({"prompt": p, **{k: v for k, v in row.items() if k not in (col, "_line")}})
    problem = reward_columns_problem(cfg, present, where(path, rows[0]))  # e.g. correctness: 'answer'
    if problem:
        raise DataError(problem)
    return out


def step_prompts(env, train_prompts: list[dict] | None, seed: int, step: int, n: int,
                 round_: int = 0) -> list[dict]:
    """The one prompt schedule of the online trainers (GRPO family, online DPO): a step's n prompt rows,
    the same on every process. From the environment, seeded by the step; from data rows, `prompt_order`.
    A dynamic-sampling round after the first (DAPO) draws n more at random, from a seed stream of its own."""
    extra = round_ * 2 ** 40  # far from every first round's seed
    if env is not None:
        rows = env.sample_prompts(n, seed=seed * 1_000_003 + step + extra)
        return [{"prompt": r["prompt"], **r["metadata"]} for r in rows]
    if round_:
        order = torch.randperm(len(train_prompts),
                               generator=torch.Generator().manual_seed(seed + seed * 1_000_003 + step + extra))
        return [train_prompts[i] for i in order[:n].tolist()]
    return [train_prompts[i] for i in prompt_order(step, len(train_prompts), n, seed)]