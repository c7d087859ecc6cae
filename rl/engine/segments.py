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
SDPA's mask, except a CPU decode step of a grouped-query model (one query position over the KV cache), which
runs as two batched matmuls (`_grouped_decode`: 1.05-1.1x the sampler's tokens/s on SmolLM2). The mask function
registered with it is SDPA's, so nothing else changes. Exact: a
sequence's tokens see the same keys as under the block-diagonal mask (tests/unit/engine/
test_packing_speed.py compares logits and gradients with the masked path).

Shared prefixes (`rl_prefix_of`, a model input beside `cu_seq_lens_q`: per segment, the index of the
segment it continues, or -1): a segment with a prefix attends to all of the prefix's keys and then
causally to its own, as if the prefix's tokens stood before it. A GRPO group's G completions (or a
DPO pair's two answers) then share one forward of their prompt (`rl.engine.packing.pack_shared_prompts`)
instead of G: the prompt's keys and values are computed once and every completion reads them.
"""

from __future__ import annotations

import torch

NAME = "rl_segments"
_registered = False


def _segment_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    prefix_of = kwargs.pop("rl_prefix_of", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(k, None)
    R, H, W, D = query.shape
    if cu is None and _grouped_decode_applies(query, key, dropout, kwargs):
        return _grouped_decode(query, key, value, attention_mask, scaling), None
    if cu is None or key.shape[2] != W:  # not a packed forward (or a cache): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    bounds = cu.tolist()
    if bounds[-1] != R * W:
        raise ValueError(f"rl_segments attention: cu_seq_lens ends at {bounds[-1]}, the rows hold {R} x {W} positions")
    prefix = prefix_of.tolist() if prefix_of is not None else [-1] * (len(bounds) - 1)

    rows = [divmod(bounds[i], W)[0] for i in range(len(bounds) - 1)]  # a segment never crosses a row
    sizes = [[] for _ in range(R)]
    for i, r in enumerate(rows):
        sizes[r].append(bounds[i + 1] - bounds[i])

    # q/k/v cut into the segments with unbind + split rather than one slice per segment: in backward a
    # slice's gradient is a zero tensor of the whole input with the slice copied in, one per segment and
    # per q/k/v in every layer; split's gradient is one concatenation
    def pieces(x):
        return [p[None] for row, n in zip(x.unbind(0), sizes) for p in row.split(n, dim=1)]

    # bf16 on a CPU (dtype: bfloat16): the segments' attention in fp32, whose SDPA kernels run short sequences
    # faster (2026-12-05, 2 cores, 9 query heads over 3, forward + backward: 42 tokens 1.02 ms in bf16 against
    # 0.45 ms cast to fp32, 121 tokens 2.48 vs 1.50 ms, 404 tokens 11.8 vs 11.4 ms); the output goes back to bf16
    dtype = query.dtype
    if query.device.type == "cpu" and dtype == torch.bfloat16:
        query, key, value = query.float(), key.float(), value.float()
    qs, ks, vs = pieces(query), pieces(key), pieces(value)
    outs = []
    for i in range(len(bounds) - 1):
        q, k, v = qs[i], ks[i], vs[i]
        mask = None
        if prefix[i] >= 0:  # the prefix's keys first, all visible; then this segment's own, causally
            n, m = q.shape[2], ks[prefix[i]].shape[2]
            k = torch.cat([ks[prefix[i]], k], dim=2)
            v = torch.cat([vs[prefix[i]], v], dim=2)
            mask = torch.ones(n, m + n, dtype=torch.bool, device=query.device).tril(m)[None, None]
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                        is_causal=mask is None, **kwargs)
        outs.append(out)  # (1, n, H, D)
    return torch.cat(outs, dim=1).reshape(R, W, H, D).to(dtype), None


def _grouped_decode_applies(query, key, dropout, kwargs) -> bool:
    """A sampler's decode step (one query position) of a grouped-query model on the CPU, with nothing but
    a padding mask (no soft-capping, sliding window, sinks or dropout)."""
    return (query.device.type == "cpu" and query.shape[2] == 1 and key.shape[1] < query.shape[1]
            and not dropout and all(kwargs.get(k) is None for k in ("softcap", "sliding_window", "s_aux")))


def _grouped_decode(query, key, value, attention_mask, scaling):
    """Attention of one new token per row over the KV cache as two batched matmuls, the query heads of a
    key/value head side by side: (B, kv, g, D) x (B, kv, D, L). SDPA on CPU takes 1.4-2x longer for this
    shape (measured 2026-12-05, 2 cores, SmolLM2's 9 query heads over 3, 256 rows x 100 cached positions:
    4.9 ms per layer against 2.3 ms; the sampler's attention 25% shorter, its tokens/s 1.05-1.1x). Same values
    up to summation order (log-probs within 3e-5 over 24 tokens, the same tokens). Returns (B, 1, H, D)."""
    B, H, _, D = query.shape
    kv, L = key.shape[1], key.shape[2]
    scores = torch.matmul(query.reshape(B, kv, H // kv, D), key.transpose(-1, -2))
    scores = scores * (scaling if scaling is not None else D ** -0.5)
    if attention_mask is not None:  # SDPA's mask: (B, 1, 1, >= L), boolean (True: attend) or additive
        mask = attention_mask[:, :, -1:, -L:]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # (B, kv, g, D)
    return out.reshape(B, 1, H, D)


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


def shared_prefix_inputs(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs of a forward over `rl.engine.packing.pack_shared_prompts`'s row."""
    cu = packed["cu_seq_lens"]
    return {"position_ids": packed["position_ids"], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "rl_prefix_of": packed["prefix_of"]}


def prefix_sharing(model) -> bool:
    """Whether shared-prompt rows (`rl_prefix_of`) can run on `model`, switching its attention to
    "rl_segments" when they can: SDPA attention, and positions that are not a learned table bounded by
    the model's length (GPT-2's `n_positions`: a packed row of several answers can outgrow it)."""
    config = getattr(getattr(model, "module", model), "config", None)
    if config is None or getattr(config, "n_positions", None) is not None:
        return False
    return enable(model)
