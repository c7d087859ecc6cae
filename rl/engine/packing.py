"""Padding-free batches: the sequences of a micro-batch concatenated into rows.

A padded micro-batch of B examples costs B x max(len) positions; a packed one sum(len). The row
carries `position_ids` that restart at 0 for each example and NO attention mask: transformers then
finds the example boundaries from the position ids (`masking_utils.find_packed_sequence_indices`:
a new example wherever the position does not grow by one) and builds a block-diagonal causal mask,
for SDPA and eager attention alike (flash attention uses the same ids as varlen boundaries), so no
token attends across examples. Each example's first label is -100: it would otherwise be "predicted"
from the previous example's last token, which the padded path never asks for (its position 0 has
no prediction). Per-token log-probs then equal the padded path's (tests/unit/engine/test_packing.py: 1e-5).

Only for models whose positions come from `position_ids` (every transformers causal LM we support:
Llama, Qwen2, Gemma, GPT-2), and only without a KV cache: transformers looks for packed rows only
when the mask is None AND there is no cache (`use_cache=False`; a model in eval mode otherwise
creates one and silently attends across examples). The engine's training forward passes
`use_cache=False`, and `attention_mask=None` when it gets `position_ids` without a mask
(`ForwardBackwardPipeline.forward_backward`, `forward_backward_custom(model_inputs=...)`).

Who packs what (`packing: true` in each trainer's config):
  SFT            `pack_examples`: a micro-batch's examples in one row; `pack_common_prefix` (default)
                 first computes the unlabeled prefix they all start with (a system prompt) once.
  DPO, reward    `pack_sequences`: the chosen and rejected sequences in rows, with `sequence_index`
                 (R, W), the sequence each token belongs to (-1 on a row's padding); `segment_sum`
                 and `pool_packed` gather per-sequence log-prob sums and pooled hidden states from it.
  online DPO     `pack_sequences` on the pairs' rollout rows (`rl.trainers.online_dpo.pack_rollout_rows`), then
                 as DPO; only the training forward is packed (the reference scores the padded rows).
  GRPO, PPO      `pack_padded`: a padded rollout's rows packed, with `target_index`, where each padded
                 target sits among the packed ones; `unpack_targets` brings per-token log-probs (and
                 PPO's entropies and values) back to the rollout's layout, so the losses, advantages
                 and old/reference log-probs stay as they were. Only the training forward is packed.
  GRPO (default) `pack_shared_prompts`: as `pack_padded`, and the rows that share a prompt (a group's G
                 completions) share one forward of it: segments with a prefix, `rl.engine.segments`.
`pack_sequences` fills rows first-fit decreasing up to the longest sequence's length (`row_tokens`):
SDPA and eager attention compute a row's whole (W, W) score matrix, masked or not, so one row of all
2B sequences would cost (sum of lengths)^2 there, more than the padded batch's 2B x (longest)^2; rows
no longer than the longest sequence never cost more than padding, in attention or anywhere else.
(GPT-2 warns once that input_ids "may be padded" when a row ends with pad tokens: they are a segment
of their own, attended by nothing else.)

Also the two pieces of the padded layout that sampling and scoring share: `left_pad` (prompts,
real tokens right-aligned) and `position_ids_from_mask` (positions counted from each row's first
attended token).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def pack_examples(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Examples with `input_ids` and `labels` (lists, same length each, HF convention) -> one row:
    input_ids, labels, position_ids, each (1, sum of lengths), long.

    labels keep each example's own values, except its first token, which becomes -100 (see the
    module docstring); position_ids count 0..len-1 within each example."""
    ids, labels, pos = [], [], []
    for e in examples:
        n = len(e["input_ids"])
        if n == 0 or len(e["labels"]) != n:
            raise ValueError(f"pack_examples: an example has {n} input_ids and {len(e['labels'])} labels; "
                             f"each needs at least one token and as many labels as input_ids")
        ids += list(e["input_ids"])
        labels += [IGNORE_INDEX] + list(e["labels"][1:])
        pos += range(n)
    as_row = lambda xs: torch.tensor(xs, dtype=torch.long)[None]  # noqa: E731
    return {"input_ids": as_row(ids), "labels": as_row(labels), "position_ids": as_row(pos)}


def pack_sequences(seqs: list[tuple[list[int], list[int]]], pad_id: int = 0,
                   row_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Sequences as (input_ids, labels) lists -> packed rows, each (R, W) long:

        input_ids, labels (each sequence's first label -100, see the module docstring), position_ids
        (0..len-1 within each sequence) and sequence_index (its index in `seqs`; -1 on padding).

    `row_tokens` (default: the longest sequence) caps a row's length: sequences go longest first into
    the first row with room (first-fit decreasing), so R <= len(seqs) and R x W <= the padded batch's
    size. A row shorter than W is filled with `pad_id` tokens that form their own segment (positions
    0, 1, ...; labels -100), so they attend only to each other and no real token sees them."""
    lengths = [len(ids) for ids, _ in seqs]
    if not seqs or min(lengths) == 0 or any(len(lab) != n for (_, lab), n in zip(seqs, lengths)):
        raise ValueError("pack_sequences: every sequence needs at least one token and as many labels as "
                         f"input_ids; got lengths {lengths}")
    width = max(lengths) if row_tokens is None else int(row_tokens)
    if width < max(lengths):
        raise ValueError(f"pack_sequences: row_tokens={width} is shorter than the longest sequence ({max(lengths)})")
    rows: list[list[int]] = []  # sequence indices per row
    room: list[int] = []
    for i in sorted(range(len(seqs)), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    W = width if len(rows) > 1 else width - room[0]  # a single row needs no padding at all
    out = {k: torch.full((len(rows), W), v, dtype=torch.long)
           for k, v in (("input_ids", pad_id), ("labels", IGNORE_INDEX), ("position_ids", 0), ("sequence_index", -1))}
    for r, members in enumerate(rows):
        t = 0
        for i in members:
            ids, lab, n = seqs[i][0], seqs[i][1], lengths[i]
            out["input_ids"][r, t:t + n] = torch.tensor(ids, dtype=torch.long)
            out["labels"][r, t + 1:t + n] = torch.tensor(lab[1:], dtype=torch.long)
            out["position_ids"][r, t:t + n] = torch.arange(n)
            out["sequence_index"][r, t:t + n] = i
            t += n
        out["position_ids"][r, t:] = torch.arange(W - t)
    return out


def segment_sum(values: torch.Tensor, sequence_index: torch.Tensor, n: int) -> torch.Tensor:
    """Per-sequence sums of per-position values: values and sequence_index (R, W) -> (n,).

    Positions with index -1 (padding) are dropped. Differentiable in `values` (index_add's backward
    is a gather), so a loss on the sums back-propagates to each token as the padded row sum does."""
    idx = sequence_index.reshape(-1)
    keep = idx >= 0
    return values.new_zeros(n).index_add(0, idx[keep], values.reshape(-1)[keep])


def pool_packed(hidden: torch.Tensor, sequence_index: torch.Tensor, n: int, strategy: str) -> torch.Tensor:
    """One vector per sequence of packed rows: hidden (R, W, H), sequence_index (R, W) -> (n, H).

    `last`: the hidden state at the sequence's last token, `cls`: at its first, `mean`: the mean over
    its tokens; the same vectors `rl.models.reward.pool_hidden` reads from a padded batch."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    idx = sequence_index.reshape(-1)
    keep = idx >= 0
    if strategy == "mean":
        sums = flat.new_zeros(n, flat.shape[-1]).index_add(0, idx[keep], flat[keep])
        counts = torch.bincount(idx[keep], minlength=n).clamp(min=1)
        return sums / counts.unsqueeze(-1).to(flat.dtype)
    if strategy not in ("last", "cls"):
        raise ValueError(f"unknown pooling_strategy {strategy!r}; use last, mean or cls")
    pos = torch.arange(idx.numel(), device=idx.device)[keep]
    fill = -1 if strategy == "last" else idx.numel()
    at = torch.full((n,), fill, dtype=torch.long, device=idx.device).scatter_reduce(
        0, idx[keep], pos, reduce="amax" if strategy == "last" else "amin", include_self=False)
    return flat[at]


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A padded batch (B, T) (left or right padding; each row's real tokens contiguous) -> its rows'
    real tokens as packed rows (`pack_sequences`), plus `target_index` (B, T-1): where each of the
    padded batch's shifted targets sits in the packed rows' shifted targets, flattened (R * (W-1)),
    -1 where the packed rows have none (padding, and each row's first real token, which the padded
    path predicts from a pad). `unpack_targets` brings per-target values back with it, so a loss
    written for the padded (B, T-1) layout (GRPO's, with its per-row advantages and old/reference
    log-probs) runs unchanged on log-probs computed packed."""
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    starts = mask.int().argmax(-1)
    B, T = input_ids.shape
    if not bool(lengths.min() > 0):
        raise ValueError("pack_padded: a row has no real token")
    if not bool((mask.cumsum(-1).gather(-1, (starts + lengths - 1)[:, None])[:, 0] == lengths).all()):
        raise ValueError("pack_padded: a row's real tokens are not contiguous (padding must be on one side)")
    seqs = [(input_ids[b, s:s + n].tolist(), labels[b, s:s + n].tolist())
            for b, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist()))]
    out = pack_sequences(seqs, pad_id)
    seq, pos = out["sequence_index"], out["position_ids"]
    W = seq.shape[1]
    r, u = torch.nonzero((seq >= 0) & (pos >= 1), as_tuple=True)  # tokens whose target the packed rows predict
    s = seq[r, u]
    target_index = torch.full((B, T - 1), -1, dtype=torch.long)
    target_index[s, starts[s] + pos[r, u] - 1] = r * (W - 1) + u - 1
    out["target_index"] = target_index
    return out


def unpack_targets(values: torch.Tensor, target_index: torch.Tensor) -> torch.Tensor:
    """Per-target values of packed rows (R, W-1) -> the padded layout (B, T-1) of `pack_padded`'s
    `target_index`, 0 where it is -1. A gather, so gradients flow back to the packed values."""
    flat = values.reshape(-1)
    return torch.where(target_index >= 0, flat[target_index.clamp(min=0)], flat.new_zeros(()))


def pack_prompt_groups(groups: list[tuple[list[int], list[tuple[list[int], list[int]]]]],
                       device=None) -> dict:
    """Groups of answers that share a prompt -> one packed row where each prompt is computed once.

    `groups`: [(prompt ids, [(answer ids, answer labels), ...]), ...]. Layout, per group with prompt p
    (length L) and answers a_1..a_k: a prefix segment p[:-1] (positions 0..L-2), then per answer a
    segment [p[-1], a_i] (positions L-1..L-1+len(a_i)) that attends to the prefix and then causally to
    itself (`rl.engine.segments`, `rl_prefix_of`). Each answer segment repeats the prompt's last token,
    so its first token is predicted from that token's hidden state as in a padded row (the same token
    at the same position over the same keys). A one-token prompt has no prefix segment.

    Returns input_ids, labels (-100 on prompt tokens), position_ids, sequence_index (the answer's index
    in group order, -1 on prefixes), each (1, W) long; `cu_seq_lens` (S+1,) int32 segment boundaries
    and `prefix_of` (S,) long (each segment's prefix segment, -1 none): the model inputs of
    `rl.engine.segments.shared_prefix_inputs`; and `starts`, the position of each answer's copy of the
    prompt's last token (the answer's j-th token is predicted at starts[i] + j)."""
    ids, lab, pos, seq, bounds, prefix_of, starts = [], [], [], [], [0], [], []
    for prompt, answers in groups:
        if not prompt:
            raise ValueError("pack_prompt_groups: a prompt has no token")
        prefix = -1
        if len(prompt) > 1:
            ids += prompt[:-1]
            lab += [IGNORE_INDEX] * (len(prompt) - 1)
            pos += range(len(prompt) - 1)
            seq += [-1] * (len(prompt) - 1)
            bounds.append(len(ids))
            prefix_of.append(-1)
            prefix = len(prefix_of) - 1
        for a_ids, a_lab in answers:
            starts.append(len(ids))
            ids += [prompt[-1]] + list(a_ids)
            lab += [IGNORE_INDEX] + list(a_lab)
            pos += range(len(prompt) - 1, len(prompt) + len(a_ids))
            seq += [len(starts) - 1] * (len(a_ids) + 1)
            bounds.append(len(ids))
            prefix_of.append(prefix)
    as_row = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)[None]  # noqa: E731
    return {"input_ids": as_row(ids), "labels": as_row(lab), "position_ids": as_row(pos),
            "sequence_index": as_row(seq), "cu_seq_lens": torch.tensor(bounds, dtype=torch.int32, device=device),
            "prefix_of": torch.tensor(prefix_of, dtype=torch.long, device=device), "starts": starts}


def pack_common_prefix(examples: list[dict]) -> dict | None:
    """SFT examples (`input_ids`, `labels`) that all begin with the same tokens carrying no loss (a chat
    template's system prompt and turn header) -> `pack_prompt_groups`' row with that prefix computed once
    and each example's rest as an answer attending to it; None when they share fewer than 2 such tokens
    (or there is one example), so the caller packs them as they are (`pack_examples`).

    Only unlabeled tokens are shared (every example's labels are -100 there), so the loss counts the
    same tokens as the padded batch; the first token after the prefix is predicted from the prefix's
    last token, as in the example itself."""
    if len(examples) < 2:
        return None
    first = examples[0]["input_ids"]
    n = min(len(e["input_ids"]) for e in examples)
    L = 0
    while L < n and all(e["input_ids"][L] == first[L] and e["labels"][L] == IGNORE_INDEX for e in examples):
        L += 1
    if L < 2:
        return None
    out = pack_prompt_groups([(list(first[:L]), [(list(e["input_ids"][L:]), list(e["labels"][L:])) for e in examples])])
    out.pop("starts")
    return out


def pack_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                        prompt_width: int) -> dict[str, torch.Tensor]:
    """A rollout batch (B, T) (prompts left-padded to `prompt_width` columns, completions after them,
    right-padded) -> `pack_prompt_groups`' row, consecutive rows with the same prompt (a GRPO group's G
    completions) forming one group: the prompt is computed once per group instead of per row, and no
    padding. Per-token log-probs equal the padded path's up to float rounding
    (tests/unit/engine/test_packing_speed.py). Adds `target_index` (B, T-1) as `pack_padded`'s, for
    `unpack_targets`."""
    B, T = input_ids.shape
    P = int(prompt_width)
    mask = attention_mask.bool().cpu()
    ids_all, lab_all = input_ids.cpu(), labels.cpu()
    groups: list = []
    lengths = []
    for b in range(B):
        prompt = ids_all[b, :P][mask[b, :P]].tolist()
        n = int(mask[b, P:].sum())
        if not prompt or not bool(mask[b, P:P + n].all()):
            raise ValueError(f"pack_shared_prompts: row {b} has no prompt token, or its completion's tokens do not "
                             f"start at column {P} contiguously (prompts left-padded, completions right-padded)")
        if not groups or groups[-1][0] != prompt:
            groups.append((prompt, []))
        groups[-1][1].append((ids_all[b, P:P + n].tolist(), lab_all[b, P:P + n].tolist()))
        lengths.append(n)
    out = pack_prompt_groups(groups, input_ids.device)
    target_index = torch.full((B, T - 1), -1, dtype=torch.long)
    for b, (start, n) in enumerate(zip(out.pop("starts"), lengths)):
        target_index[b, P - 1:P - 1 + n] = torch.arange(start, start + n)
    out["target_index"] = target_index.to(input_ids.device)
    return out

# ------------------------------------------------------------------------------------ pure pieces

def left_pad(prompts: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask, real tokens right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (add a BOS token to empty prompts)")
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids.to(device), mask.to(device)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted from each row's first attended token (0 on the left padding)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
