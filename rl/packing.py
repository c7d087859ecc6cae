"""Padding-free batches: the examples of a micro-batch concatenated into one row.

A padded micro-batch of B examples costs B x max(len) positions; a packed one sum(len). The row
carries `position_ids` that restart at 0 for each example and NO attention mask: transformers then
finds the example boundaries from the position ids (`masking_utils.find_packed_sequence_indices`:
a new example wherever the position does not grow by one) and builds a block-diagonal causal mask,
for SDPA and eager attention alike (flash attention uses the same ids as varlen boundaries), so no
token attends across examples. Each example's first label is -100: it would otherwise be "predicted"
from the previous example's last token, which the padded path never asks for (its position 0 has
no prediction). Per-token log-probs then equal the padded path's (tests/test_packing.py: 1e-5).

Only for models whose positions come from `position_ids` (every transformers causal LM we support:
Llama, Qwen2, Gemma, GPT-2), and only without a KV cache: transformers looks for packed rows only
when the mask is None AND there is no cache (`use_cache=False`; a model in eval mode otherwise
creates one and silently attends across examples). The engine's training forward passes
`use_cache=False`, and `attention_mask=None` when it gets `position_ids` without a mask
(`ForwardBackwardPipeline.forward_backward`).
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
