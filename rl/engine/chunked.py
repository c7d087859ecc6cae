"""Log-probs of the labels without the (B, T, V) logits: the LM head run a chunk of positions at a time.

At a 152k vocabulary, B = 8 and T = 2048 the fp32 logits alone are 10 GB, and the log-softmax's
backward keeps as much again. What a trainer needs from them is two numbers per position: the
log-prob of the label, log p(y_t) = z_t[y_t] - logsumexp(z_t), and sometimes the entropy
H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v. Both depend only on position t's logits, so
they can be computed over C positions at a time, each chunk under `torch.utils.checkpoint`: the
forward keeps only the chunk's inputs (a view of the hidden states), the backward recomputes that
chunk's logits, so at most one (B, C, V) chunk of logits (and its gradient) exists, forward or
backward. Peak memory: ~3 x B*C*V floats instead of ~2-3 x B*T*V. Only positions that have a
target (labels != -100) go through the head at all: prompts and padding cost nothing there.

How the trainers get it without changing their losses: `capture_head(model)` makes the model's LM
head, for one forward call, return a `HeadLogits` instead of computing its output. That is the
model's own forward, through every wrapper (DDP, DeepSpeed, PEFT), so the final norm, LoRA on the
head and tied embeddings are exactly the model's; the elementwise steps models apply after the head
(Gemma 2's `final_logit_softcapping`: / cap, tanh, * cap; a temperature `/ t`; `.float()`) are
recorded and replayed per chunk. `rl.engine.losses.token_logprobs` and `HeadLogits.logprobs` compute from
it chunk by chunk; anything else done with it (any torch function or tensor attribute) materialises
the full logits first, so a custom loss gets the same numbers as before, at the old cost.

The head is called as a module per chunk, so ZeRO-3 gathers its (sharded) weight for each call and
for each recomputation in backward, as it does for gradient-checkpointed layers. Autocast state at
capture time is replayed, so mixed precision computes the chunks as the full head would.
`auto_capture_head(model, input_ids, chunk_size)`, the context the engine's forwards use, captures the
head only when `auto_chunk_size` chunks (`chunk_size` given, or B*T*V above AUTO_MIN_ELEMENTS);
otherwise the forward is the plain one.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from rl.engine.dist import is_zero3

IGNORE_INDEX = -100

# Chunking starts when the logits would hold more than AUTO_MIN_ELEMENTS values (B*T*V), and then
# uses chunks of about CHUNK_ELEMENTS values: 2**25 fp32 = 128 MiB per chunk; below 2**26 (256 MiB)
# the full logits are cheap and one matmul is faster.
CHUNK_ELEMENTS = 2 ** 25
AUTO_MIN_ELEMENTS = 2 ** 26


def auto_chunk_size(batch: int, length: int, vocab: int, chunk_size: int | None = None) -> int | None:
    """Positions per chunk for (batch, length, vocab) logits: `chunk_size` when given (0: None, never
    chunk), else None (the full path) up to AUTO_MIN_ELEMENTS logits and ~CHUNK_ELEMENTS // (batch *
    vocab) above."""
    if chunk_size is not None:
        return int(chunk_size) or None
    if batch * length * vocab <= AUTO_MIN_ELEMENTS:
        return None
    return max(1, CHUNK_ELEMENTS // max(1, batch * vocab))


def output_head(model):
    """The LM head module of `model` (through accelerate/DeepSpeed/DDP and PEFT wrappers), or None."""
    m = model
    while hasattr(m, "module") and isinstance(m.module, torch.nn.Module):  # DDP, DeepSpeed engine
        m = m.module
    for _ in range(3):  # PEFT PeftModel -> LoraModel -> the causal LM; our PPOModel -> its base_model
        get = getattr(m, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if isinstance(head, torch.nn.Module):
            return head
        m = getattr(m, "base_model", None)
        if m is None:
            return None
    return None


def head_vocab(head) -> int:
    """Output size V of an LM head (a Linear, or a PEFT LoRA layer around one)."""
    base = getattr(head, "base_layer", head)
    return int(getattr(base, "out_features", None) or base.weight.shape[0])


class HeadLogits:
    """Stand-in for the logits `ops(head(hidden))`, (B, T, V), computed only chunk by chunk.

    hidden: (B, T, H) the head's input; head: the LM head module; ops: elementwise functions the
    model applied to the head's output, in order; chunk_size: positions per chunk."""

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module, chunk_size: int, ops: tuple = (),
                 autocast: tuple | None = None):
        self.hidden, self.head, self.chunk_size, self.ops = hidden, head, int(chunk_size), tuple(ops)
        self.autocast = autocast if autocast is not None else _autocast_state(hidden.device.type)

    # ---------------------------------------------------------------- lazily recorded steps
    def _then(self, op) -> "HeadLogits":
        return HeadLogits(self.hidden, self.head, self.chunk_size, self.ops + (op,), self.autocast)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], head_vocab(self.head)))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    @property
    def dtype(self) -> torch.dtype:
        """The logits' dtype, known without computing them (accelerate's mixed-precision wrapper reads it to
        decide whether to call `.float()`, which stays lazy)."""
        device_type, enabled, dtype = self.autocast
        out = dtype if enabled and dtype is not None else torch.promote_types(
            self.hidden.dtype, getattr(getattr(self.head, "base_layer", self.head), "weight", self.hidden).dtype)
        return torch.float32 if _to_float in self.ops else out

    def dim(self) -> int:
        return self.hidden.dim()

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def float(self) -> "HeadLogits":
        return self._then(_to_float)

    def __truediv__(self, other):
        if isinstance(other, (int, float)):
            return self._then(_Div(float(other)))
        return self.materialize() / other

    def __mul__(self, other):
        if isinstance(other, (int, float)):
            return self._then(_Mul(float(other)))
        return self.materialize() * other

    __rmul__ = __mul__

    def __getitem__(self, index):
        """Slicing the batch and position dimensions stays lazy (it slices the hidden states)."""
        idx = index if isinstance(index, tuple) else (index,)
        if len(idx) <= 2 and all(isinstance(i, slice) for i in idx):
            return HeadLogits(self.hidden[idx], self.head, self.chunk_size, self.ops, self.autocast)
        return self.materialize()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tanh and len(args) == 1 and isinstance(args[0], HeadLogits) and not kwargs:
            return args[0]._then(torch.tanh)
        return func(*_materialize_all(args), **_materialize_all(kwargs))

    def __getattr__(self, name):
        # any other tensor attribute or method: on the full logits (the old path, same numbers)
        if name.startswith("_") or name in ("hidden", "head", "chunk_size", "ops", "autocast"):  # not set yet
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    # ---------------------------------------------------------------- computing
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        device_type, enabled, dtype = self.autocast
        # inside `capture_head`'s block the head's call is captured; this call must compute
        self.head.__dict__["_rl_computing"] = True
        try:
            with torch.autocast(device_type, dtype=dtype, enabled=enabled) if enabled else contextlib.nullcontext():
                z = self.head(hidden)
        finally:
            self.head.__dict__.pop("_rl_computing", None)
        for op in self.ops:
            z = op(z)
        return z

    def materialize(self) -> torch.Tensor:
        """The full (B, T, V) logits, as the model would have returned them."""
        return self._logits(self.hidden)

    def logprobs(self, targets: torch.Tensor, with_entropy: bool = False):
        """Per-position log-prob (B, T) in fp32 of `targets` (B, T) (valid token ids: mask them
        yourself) under softmax(logits), and with `with_entropy` also the entropy (B, T) of that
        distribution; differentiable, at most one (B, chunk, V) block of logits alive at a time."""
        T = self.hidden.shape[1]
        if targets.shape != self.hidden.shape[:2]:
            raise ValueError(f"targets {tuple(targets.shape)} do not match the logits' (B, T) "
                             f"{tuple(self.hidden.shape[:2])}")
        outs = []
        for s in self._starts(T):
            h, y = self.hidden[:, s:s + self.chunk_size], targets[:, s:s + self.chunk_size]
            if torch.is_grad_enabled() and h.requires_grad:
                outs.append(checkpoint(self._chunk, h, y, with_entropy, use_reentrant=False))
            else:
                outs.append(self._chunk(h, y, with_entropy))
        logp = torch.cat([o[0] for o in outs], dim=1)
        if not with_entropy:
            return logp
        return logp, torch.cat([o[1] for o in outs], dim=1)

    @torch.no_grad()
    def argmax(self, dim: int = -1) -> torch.Tensor:
        """(B, T) argmax over the vocabulary, chunk by chunk (no gradient flows through an argmax, so
        nothing is kept for backward): SFT's mean_token_accuracy without the (B, T, V) logits."""
        if dim not in (-1, self.hidden.dim() - 1):
            return self.materialize().argmax(dim)
        return torch.cat([self._logits(self.hidden[:, s:s + self.chunk_size]).argmax(-1)
                          for s in self._starts(self.hidden.shape[1])], dim=1)

    def _starts(self, T: int) -> range:
        """The chunks' first positions. Under ZeRO-3 every call of a partitioned head gathers its weight, a
        collective, here and again when backward recomputes the chunk: all processes must make as many calls,
        so the number of chunks is the largest over processes and the extra chunks are empty (measured before:
        GRPO on 2 CPU processes, whose batches hold different lengths, aborted in gloo with "Received data size
        doesn't match expected size")."""
        n = -(-T // self.chunk_size)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and is_zero3(self.head):
            count = torch.tensor([n], device=self.hidden.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            n = int(count)
        return range(0, n * self.chunk_size, self.chunk_size)

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
        z = self._logits(hidden).float()
        logz = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
        if not with_entropy:
            return (logp,)
        entropy = logz - (torch.softmax(z, dim=-1) * z).sum(-1)
        return logp, entropy


def _on_full(name):
    def op(self, *args):
        return getattr(self.materialize(), name)(*args)
    op.__name__ = name
    return op


# the other operators also work, on the full logits
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__rtruediv__", "__neg__", "__pow__", "__matmul__",
              "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"):
    setattr(HeadLogits, _name, _on_full(_name))
HeadLogits.__hash__ = object.__hash__


class _Div:
    def __init__(self, d: float):
        self.d = d

    def __call__(self, z):
        return z / self.d


class _Mul:
    def __init__(self, m: float):
        self.m = m

    def __call__(self, z):
        return z * self.m


def _to_float(z):
    return z.float()


def _autocast_state(device_type: str) -> tuple:
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):  # a device type without autocast
        return device_type, False, None


def _materialize_all(x):
    if isinstance(x, HeadLogits):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(_materialize_all(v) for v in x)
    if isinstance(x, dict):
        return {k: _materialize_all(v) for k, v in x.items()}
    return x


def chunked_token_logprobs(logits: HeadLogits, labels: torch.Tensor, with_entropy: bool = False):
    """`rl.engine.losses.token_logprobs` for `HeadLogits`: (logp (B, T-1) zero where masked, mask (B, T-1)
    float) of `labels` (B, T) (HF convention, -100 ignored, shifted here), plus the entropy (B, T-1)
    with `with_entropy`.

    Only the n counted positions go through the head (prompts and padding have no target, so their
    logits cannot change the result): their hidden states are gathered into one (1, n, H) row and
    run `chunk_size * B` positions at a time, the same block size as B rows of `chunk_size`."""
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    hidden = logits.hidden[:, :-1]
    B = hidden.shape[0]
    sel = mask.clone()
    if not bool(sel.any()):  # nothing counted: one position anyway, so the head stays in the graph (DDP
        sel.view(-1)[0] = True  # expects a gradient, zero here, for every parameter)
    counted = HeadLogits(hidden[sel][None], logits.head, logits.chunk_size * B, logits.ops, logits.autocast)
    out = counted.logprobs(target.masked_fill(~mask, 0)[sel][None], with_entropy)
    out = out if with_entropy else (out,)
    # back to (B, T-1), zero where masked; the scatter's backward routes each gradient to its position
    full = [hidden.new_zeros(mask.shape, dtype=o.dtype).masked_scatter(sel, o[0]) * mask for o in out]
    if with_entropy:
        return full[0], mask.float(), full[1]
    return full[0], mask.float()


@contextlib.contextmanager
def capture_head(model, chunk_size: int):
    """For the model calls inside this block, the LM head returns a `HeadLogits` of its input (the
    logits are computed later, chunk by chunk, by whoever needs them). Yields False, and changes
    nothing, when the model has no separate head module."""
    head = output_head(model)
    if head is None:
        yield False
        return

    def capturing_forward(hidden, *args, **kwargs):
        # not the plain `head(hidden)` call we know how to defer, or a HeadLogits computing its logits
        if args or kwargs or head.__dict__.get("_rl_computing"):
            return original(hidden, *args, **kwargs)
        return HeadLogits(hidden, head, chunk_size)

    original = head.forward
    had_own = "forward" in head.__dict__
    head.forward = capturing_forward
    try:
        yield True
    finally:
        if had_own:
            head.forward = original
        else:
            del head.forward


def auto_capture_head(model, input_ids: torch.Tensor, chunk_size: int | None = None, always: bool = False):
    """The context of one forward of `model` on `input_ids` (B, T): `capture_head` with the chunk
    `auto_chunk_size` picks (`chunk_size` when given, 0: never; else automatic above
    AUTO_MIN_ELEMENTS logits), or a null context when it does not chunk or the model has no head.
    `always`: with `chunk_size` None, capture below AUTO_MIN_ELEMENTS too (chunks of ~CHUNK_ELEMENTS
    logits), for a loss that computes from a `HeadLogits` at no extra cost (`rl.engine.fused_head`)."""
    head = output_head(model)
    if head is None:
        return contextlib.nullcontext()
    B, T, V = input_ids.shape[0], input_ids.shape[1], head_vocab(head)
    chunk = auto_chunk_size(B, T, V, chunk_size)
    if always and chunk_size is None and not chunk:
        chunk = max(1, CHUNK_ELEMENTS // max(1, B * V))
    return capture_head(model, chunk) if chunk else contextlib.nullcontext()
