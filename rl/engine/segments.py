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
test_packing_speed.py compares logits and gradients with the masked path). In bf16 on a CPU the segments attend in
fp32, and a long segment's backward runs in bf16 matmuls where the CPU has them (`_BF16Backward`).

Shared prefixes (`rl_prefix_of`, a model input beside `cu_seq_lens_q`: per segment, the index of the
segment it continues, or -1): a segment with a prefix attends to all of the prefix's keys and then
causally to its own, as if the prefix's tokens stood before it. A GRPO group's G completions (or a
DPO pair's two answers) then share one forward of their prompt (`rl.engine.packing.pack_shared_prompts`)
instead of G: the prompt's keys and values are computed once and every completion reads them.
"""

from __future__ import annotations

import contextlib
import functools

import torch

NAME = "rl_segments"
# from this many query tokens a bf16 segment's backward is faster in bf16 matmuls than in the fp32 flash kernel
# (2026-12-07, 2 cores, AVX512-BF16, forward + backward: 64 tokens 0.52 vs 0.44 ms, 80 0.62 vs 0.66, 121 0.98 vs 1.23)
BF16_BACKWARD_MIN = 80
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

    # bf16 on a CPU (dtype: bfloat16, autocast; or bf16 weights): the segments' attention computed in fp32, whose
    # SDPA kernels run short sequences faster (2026-12-07, 2 cores, 9 query heads over 3, forward + backward: 48
    # tokens 0.32 ms against 1.66 ms for SDPA in bf16, 121 tokens 1.23 vs 3.44 ms, 404 tokens 9.4 vs 10.8 ms), out
    # of autocast's reach (it lists SDPA among its bf16 ops; the rotated q and k reach here in fp32 under autocast,
    # v in bf16); the output is bf16. With gradients, where the CPU multiplies bf16 natively, a segment of
    # BF16_BACKWARD_MIN tokens or more takes _BF16Backward (its backward in bf16 matmuls) instead.
    low = query.device.type == "cpu" and (torch.bfloat16 in (query.dtype, value.dtype) or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16))
    bf16_backward = low and _bf16_backward_applies(query, key, value, dropout, kwargs)
    dtype = torch.bfloat16 if low else query.dtype
    qs, ks, vs = pieces(query), pieces(key), pieces(value)
    outs = []
    with torch.autocast("cpu", enabled=False) if low else contextlib.nullcontext():
        for i in range(len(bounds) - 1):
            q, k, v = qs[i], ks[i], vs[i]
            if prefix[i] >= 0:  # the prefix's keys first, all visible; then this segment's own, causally
                k = torch.cat([ks[prefix[i]], k], dim=2)
                v = torch.cat([vs[prefix[i]], v], dim=2)
            if bf16_backward and q.shape[2] >= BF16_BACKWARD_MIN:
                scale = scaling if scaling is not None else q.shape[-1] ** -0.5
                outs.append(_BF16Backward.apply(q, k, v, scale).transpose(1, 2))
                continue
            n, m = q.shape[2], k.shape[2] - q.shape[2]
            mask = _visible(n, m, query.device)[None, None] if m else None
            if low:
                q, k, v = q.float(), k.float(), v.float()
            out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                            is_causal=mask is None, **kwargs)
            outs.append(out.to(dtype))  # (1, n, H, D)
    return torch.cat(outs, dim=1).reshape(R, W, H, D), None


def _plain_attention(dropout, kwargs) -> bool:
    """Nothing but a mask: no soft-capping, sliding window, sinks or dropout."""
    return not dropout and all(kwargs.get(k) is None for k in ("softcap", "sliding_window", "s_aux"))


@functools.cache
def _native_bf16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _bf16_backward_applies(query, key, value, dropout, kwargs) -> bool:
    """A bf16 forward with gradients on a CPU that multiplies bf16 natively."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            and _plain_attention(dropout, kwargs) and _native_bf16())


class _BF16Backward(torch.autograd.Function):
    """One segment's attention: forward by SDPA's fp32 flash kernel (the output and its log-sum-exp), backward
    by batched bf16 matmuls with the probabilities recomputed from the log-sum-exp, the query heads of a
    key/value head side by side. The CPU flash kernel's backward is most of a bf16 SFT step's attention (0.44 of
    0.56 s per step on SmolLM2); forward + backward take 1.3-1.5x less time at 121-404 tokens on 2 cores
    (2026-12-07, AVX512-BF16, freed memory kept: 0.98 vs 1.23 ms at 121, 2.45 vs 3.77 at 250, 6.3 vs 9.4 at 404;
    its (n, L) temporaries are fresh pages each call where malloc is not tuned), with gradients at bf16 SDPA's
    precision (tests/unit/engine/test_packing_speed.py). Memory as flash attention's: q, k, v, the output and the
    log-sum-exp are kept, no (n, L) matrix. q (1, H, n, D); k, v (1, KV, L, D): L - n prefix keys, all
    visible, then causal over the segment's own."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        H, n = q.shape[1], q.shape[2]
        g, m = H // k.shape[1], k.shape[2] - n
        mask = None
        if m:  # the flash kernel takes an additive mask of the query's dtype
            mask = torch.zeros(n, m + n, device=q.device).masked_fill_(~_visible(n, m, q.device), float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1), 0.0, m == 0,
            attn_mask=None if mask is None else mask[None, None], scale=scale)
        ctx.save_for_backward(*(t.bfloat16() for t in (q, k, v)), out, lse)
        ctx.scale, ctx.dtypes = scale, (q.dtype, k.dtype, v.dtype)
        return out.bfloat16()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        H, n, D = q.shape[1:]
        kv, L = k.shape[1], k.shape[2]
        g, rows = H // kv, H // kv * n
        qg, kk, vv = q[0].reshape(kv, rows, D), k[0], v[0]
        do = dout[0].bfloat16().reshape(kv, rows, D)
        p = torch.bmm(qg, kk.transpose(1, 2)).float().mul_(ctx.scale).sub_(lse[0].reshape(kv, rows, 1)).exp_()
        p = p.masked_fill_(~_visible(n, L - n, q.device).repeat(g, 1), 0.0)  # after exp: 2x faster than -inf before
        dv = torch.bmm(p.bfloat16().transpose(1, 2), do)
        delta = (dout[0].float() * out[0]).sum(-1).reshape(kv, rows, 1)
        ds = torch.bmm(do, vv.transpose(1, 2)).float().sub_(delta).mul_(p).mul_(ctx.scale).bfloat16()
        dq, dk = torch.bmm(ds, kk).reshape(1, H, n, D), torch.bmm(ds.transpose(1, 2), qg)[None]
        return *(grad.to(t) for grad, t in zip((dq, dk, dv[None]), ctx.dtypes)), None


def _visible(n: int, m: int, device) -> torch.Tensor:
    """(n, m + n) booleans: m prefix keys all visible, then causal."""
    return torch.ones(n, m + n, dtype=torch.bool, device=device).tril(m)


def _grouped_decode_applies(query, key, dropout, kwargs) -> bool:
    """A sampler's decode step (one query position) of a grouped-query model on the CPU, with nothing but
    a padding mask (no soft-capping, sliding window, sinks or dropout)."""
    return (query.device.type == "cpu" and query.shape[2] == 1 and key.shape[1] < query.shape[1]
            and _plain_attention(dropout, kwargs))


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
