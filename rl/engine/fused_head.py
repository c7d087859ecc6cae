"""The LM head and the next-token NLL in one pass, the gradients computed in that same pass.

SFT's loss needs, per counted position, logsumexp(z) - z[y] with z = W h (+ b). Computed the plain way
the (N, V) logits exist in fp32 (49,152 x 4 bytes per token for SmolLM2), then a log-softmax over them,
then in backward the same sizes again for the softmax's gradient and the logits' gradient: several
passes over N x V floats on top of the three matmuls. Here the counted positions' hidden states are run
`rows` at a time: the chunk's logits, their logsumexp, the target logit and the argmax come from one
(rows, V) block, which then becomes, in place, softmax - onehot, the gradient of the NLL sum with
respect to the logits. Its products with W and with h are the chunk's gradient of the hidden states
and its contribution to the gradient of the head weight. So the logits are computed once (not again in
backward, as the checkpointed chunks of `rl.engine.chunked` do), and at most one (rows, V) block is alive.

That is possible because the result is one scalar, the NLL sum: its gradient in backward is that scalar
times the gradients computed in forward. Memory held from forward to backward: the gradient of the
hidden states (N, H) and of the weight (V, H), the size of the weight's own gradient.

* Tied embeddings (SmolLM2): the head's weight is the embedding's Parameter; its gradient from here
  is accumulated by autograd with the embedding's own.
* A head that does not train (LoRA elsewhere, frozen): no weight gradient is computed.
* bf16 autocast: the matmuls run in the autocast dtype, as the model's own head would, and the
  logsumexp / softmax in fp32; the weight gradient is accumulated in fp32.
"""

from __future__ import annotations

import torch

from rl.engine.chunked import _to_float

IGNORE_INDEX = -100

# Rows of hidden states per chunk when called directly: a (rows, V) fp32 block of 512 x 49,152 is 96 MiB;
# on the 2-core machine 512-1024 rows ran the head + NLL + gradients ~5-8% faster than the plain
# F.linear + cross_entropy at 1,100 positions, 128 rows ~3% slower.
DEFAULT_ROWS = 512


class _LinearNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, dtype):
        # hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) valid ids; dtype: the matmul dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        N = hidden.shape[0]
        acc = torch.promote_types(dtype, torch.float32)  # fp32 at least for the softmax and the sums
        nll = torch.zeros((), dtype=acc, device=hidden.device)
        correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None  # the first chunk's product, then accumulated into (no zero-filled (V, H) first)
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here, explicitly
            for s in range(0, N, rows):
                h = hidden[s:s + rows].to(dtype)
                y = targets[s:s + rows]
                z = (h @ w.t() if b is None else torch.addmm(b, h, w.t())).to(acc)
                # one pass for the max and the argmax, then exp(z - max) in place and its sum: logsumexp,
                # and after one division, softmax(z), in the block's own storage
                m, best = z.max(-1)
                picked = z.gather(1, y[:, None]).squeeze(1)
                correct += (best == y).sum()
                z.sub_(m[:, None]).exp_()
                total = z.sum(-1)
                nll += (m + total.log() - picked).sum()
                if not (need_h or need_w or need_b):
                    continue
                g = z.div_(total[:, None])  # d(sum of nll)/dz = softmax(z) - onehot(y)
                g[torch.arange(g.shape[0], device=g.device), y] -= 1.0
                g = g.to(dtype)
                if need_h:
                    grad_h[s:s + rows] = (g @ w).to(hidden.dtype)
                if need_w and grad_w is None:
                    grad_w = (g.t() @ h).to(acc)
                elif need_w and dtype == acc:
                    grad_w.addmm_(g.t(), h)
                elif need_w:
                    grad_w.add_((g.t() @ h).to(acc))
                if need_b:
                    grad_b.add_(g.to(acc).sum(0))
        if need_w and grad_w is None:  # no position at all
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w, grad_b) if t is not None))
        ctx.have = (need_h, need_w, need_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(correct)
        return nll, correct

    @staticmethod
    def backward(ctx, grad_nll, _grad_correct):
        saved = list(ctx.saved_tensors)
        need_h, need_w, need_b = ctx.have
        out_h = out_w = out_b = None
        if need_h:
            t = saved.pop(0)
            out_h = t * grad_nll.to(t.dtype)
        if need_w:
            t = saved.pop(0)
            out_w = (t * grad_nll).to(ctx.dtypes[0])
        if need_b:
            t = saved.pop(0)
            out_b = (t * grad_nll).to(ctx.dtypes[1])
        return out_h, out_w, out_b, None, None, None


def linear_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
               rows: int = DEFAULT_ROWS, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over positions of -log softmax(hidden @ weight.T + bias)[target], positions with target ==
    IGNORE_INDEX left out, without the (N, V) logits: (nll_sum fp32 scalar, differentiable in hidden,
    weight and bias; number of positions whose argmax is the target, an int64 scalar).

    hidden: (..., H); targets: (...) token ids or IGNORE_INDEX; weight (V, H); bias (V,) or None.
    dtype: the matmul dtype (default: the autocast dtype when autocast is on for hidden's device, else
    hidden's dtype)."""
    if dtype is None:
        dev = hidden.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    keep = y != IGNORE_INDEX
    if not bool(keep.all()):
        h, y = h[keep], y[keep]
    return _LinearNLL.apply(h, weight, bias, y, max(1, int(rows)), dtype)


def plain_head(head) -> bool:
    """Whether `head` is a plain `nn.Linear` (its weight and bias are all there is to it), i.e. one the
    fused pass can stand in for; a LoRA-wrapped or quantised head is not, nor one whose weight ZeRO-3
    partitions (gathered only inside the module's own call)."""
    return type(head) is torch.nn.Linear and getattr(head.weight, "ds_id", None) is None


def head_nll(logits, labels: torch.Tensor, rows: int | None = None):
    """For a `rl.engine.chunked.HeadLogits` of a plain linear head with no elementwise steps after it but
    `.float()`: (nll_sum, correct) of `labels` (B, T) (HF convention, shifted here, -100 ignored) as in
    `linear_nll`; only the counted positions go through the head. None when the head or the recorded
    steps are something else (the caller then takes the chunked path, same numbers). `rows`: positions per
    chunk, by default B x the HeadLogits' chunk size, the block `rl.engine.chunked` would compute at once
    (so `logprob_chunk_size` keeps its meaning)."""
    if rows is None:
        rows = logits.chunk_size * logits.hidden.shape[0]
    head = logits.head
    if not plain_head(head) or any(op is not _to_float for op in logits.ops):
        return None
    device_type, enabled, dtype = logits.autocast
    hidden = logits.hidden[:, :-1]
    mm_dtype = dtype if enabled else hidden.dtype
    target = labels[:, 1:].to(hidden.device)
    if not bool((target != IGNORE_INDEX).any()):
        # nothing counted: still one position through the head, times zero, so that every parameter gets
        # a (zero) gradient, which DDP expects
        nll, correct = linear_nll(hidden[:, :1], head.weight, torch.zeros_like(target[:, :1]), head.bias, rows,
                                  mm_dtype)
        return nll * 0.0, correct * 0
    return linear_nll(hidden, head.weight, target, head.bias, rows, mm_dtype)
