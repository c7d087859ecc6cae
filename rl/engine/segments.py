"""Attention over packed rows that pays only for each sequence's own causal block.

A packed row (`rl.engine.packing`) holds several sequences; with SDPA transformers builds a
block-diagonal causal mask from the position ids, and SDPA on CPU then computes the row's whole
(W, W) score matrix: one row of 8 SFT examples of 42-404 tokens costs (sum of lengths)^2, several
times the padded batch's attention. Flash attention's varlen kernel (GPU only) takes the sequence
boundaries as `cu_seq_lens_q/k` instead. This module gives CPU (and any SDPA device) the same:

    enable(model)               switch a model whose attention is "sdpa" to "rl_segments" (a registered
                                transformers attention function); a no-op for eager / flash / others
    cu_seq_lens(position_ids)   the boundaries of the sequences in packed rows, from their position ids
                                (a sequence starts wherever the position is 0), flattened over the rows
                                as flash attention's varlen API expects them

"rl_segments" runs SDPA causally on each sequence's slice of q/k/v when the forward carries
`cu_seq_lens_q` (the packed training forwards pass it as a model input), so the attention costs
sum(len^2); without it (padded batches, generation, evaluation) it IS transformers' SDPA, with
SDPA's mask. The mask function registered with it is SDPA's, so nothing else changes. Exact: a
sequence's tokens see the same keys as under the block-diagonal mask (tests/unit/engine/
test_packing_speed.py compares logits and gradients with the masked path).
"""

from __future__ import annotations

import torch

NAME = "rl_segments"
_registered = False


def _segment_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(k, None)
    R, H, W, D = query.shape
    if cu is None or key.shape[2] != W:  # not a packed forward (or a cache): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    bounds = cu.tolist()
    if bounds[-1] != R * W:
        raise ValueError(f"rl_segments attention: cu_seq_lens ends at {bounds[-1]}, the rows hold {R} x {W} positions")
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        r, a = divmod(s, W)  # a sequence never crosses a row (pack_sequences / pack_examples)
        b = a + (e - s)
        out, _ = sdpa_attention_forward(module, query[r:r + 1, :, a:b], key[r:r + 1, :, a:b], value[r:r + 1, :, a:b],
                                        None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        outs.append(out)  # (1, n, H, D)
    return torch.cat(outs, dim=1).reshape(R, W, H, D), None


def register() -> None:
    """Register "rl_segments" with transformers (attention function + SDPA's mask), once."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    AttentionInterface.register(NAME, _segment_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _registered = True


def enable(model) -> bool:
    """Route `model`'s SDPA attention through "rl_segments"; True when it did. Other attention
    implementations (eager, flash attention: it reads cu_seq_lens itself) are left as they are."""
    base = getattr(model, "module", model)  # DDP / DeepSpeed engines wrap the model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return getattr(config, "_attn_implementation", None) == NAME
    register()
    for m in base.modules():  # PEFT wraps the transformers model: switch every config-holding submodule
        c = getattr(m, "config", None)
        if c is not None and getattr(c, "_attn_implementation", None) == "sdpa":
            c._attn_implementation = NAME
    return True


def cu_seq_lens(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows' position ids (R, W) -> int32 boundaries [0, ..., R*W] of their sequences, flattened
    row after row (a sequence starts at each position 0, and at each row's start)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0, as_tuple=True)[0]
    W = position_ids.shape[-1]
    row_starts = torch.arange(0, flat.numel(), W, device=flat.device)
    starts = torch.unique(torch.cat([starts, row_starts]))
    end = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, end]).to(torch.int32)


def model_inputs(position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword inputs of a packed forward: position ids and the sequences' boundaries."""
    cu = cu_seq_lens(position_ids)
    return {"position_ids": position_ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
