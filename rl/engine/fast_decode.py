"""What makes CPU sampling fast without changing its numbers: linear weights prepacked (a context manager that
`rl.engine.generation.generate` holds for one rollout; it also merges a LoRA policy's adapters for it:
`rl.engine.lora.lora_merged`), and a KV cache written in place (`preallocated_dynamic_cache`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


# Below this many new tokens, prepacking the weights (a copy of every linear weight, ~0.3 s for 135M
# parameters on 2 cores) costs more than it saves (~25 ms per decode step there).
PREPACK_MIN_NEW_TOKENS = 16


@contextmanager
def prepacked_linears(model, rows: int, dtype: torch.dtype = torch.float32):
    """On CPU, for the duration of a rollout, every fp32 `nn.Linear` of `model` computes with a copy of
    its weight reordered once for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`), instead of the
    default matmul, which re-packs the weight at every call.

    Why: decoding a few rows per step is a matmul of a (rows, K) input with every weight; measured on
    this project's 2-core machines (2026-12-02) a (16, 576) x (576, 1536) product took ~490 us plainly and
    ~330 us prepacked, and SmolLM2-135M sampled 16 rows x 48 tokens ~20% faster. The result is the same
    fp32 product up to summation order. The copies (one per weight, the model's linear weights again)
    live only inside this block. A module that already has its own `forward` attribute (accelerate's
    offloading hooks) is left alone, and so is everything when oneDNN is unavailable.

    dtype=torch.bfloat16 (`rollout_dtype: bfloat16`): the copies are bf16 and each linear computes in bf16
    (its input cast, its output cast back to fp32), as autocast would but without casting every weight at
    every token; norms, attention, the KV cache and the sampling stay fp32. On a CPU with AVX512-BF16
    (2026-12-05, 2 cores) a (64, 576) x (576, 1536) product took 519 us prepacked fp32 and 273 us bf16,
    the LM head at 256 rows 86 ms and 36 ms. The log-probs then differ from the fp32 policy's (bf16's
    8-bit mantissa): the trainer measures and corrects that as it does vLLM's (`sampling/*`)."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__
               and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not linears or not torch.backends.mkldnn.is_available():
        yield
        return
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().to(dtype), rows) for m in linears]
    except (RuntimeError, AttributeError):  # an op this build lacks: the plain path
        yield
        return
    for m, w in zip(linears, packed):
        bias = None if m.bias is None else m.bias.detach().to(dtype)

        def forward(x, m=m, w=w, bias=bias):
            if x.dtype != torch.float32:  # bf16 autocast (dtype: bfloat16 on a CPU): the plain path, as autocast casts
                return torch.nn.functional.linear(x, m.weight, m.bias)
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).to(dtype), w, bias, "none", [], "")
            return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        m.forward = forward
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A `DynamicLayer` whose keys and values live in a buffer allocated once for the whole rollout
        (prompt + max_new_tokens positions): each decode step writes its token's key and value in place
        and the layer exposes a view of the filled part. HF's `DynamicLayer` concatenates instead, which
        copies the whole cache of every layer at every token: at 256 rows x ~150 positions on
        SmolLM2-135M that is ~1 GB of copies per decode step, growing with rows x length. Same values,
        so the same attention and tokens; a write past the buffer reallocates it (a longer call)."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = int(capacity)
            self._k = self._v = None
            self._n = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def _view(self):
            self.keys, self.values = self._k[..., :self._n, :], self._v[..., :self._n, :]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, new = self._n, key_states.shape[-2]
            if self._k is None or n + new > self._k.shape[-2]:
                cap = max(self.capacity, n + new)
                k = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
                v = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
                if n:
                    k[..., :n, :] = self._k[..., :n, :]
                    v[..., :n, :] = self._v[..., :n, :]
                self._k, self._v = k, v
            self._k[..., n:n + new, :] = key_states
            self._v[..., n:n + new, :] = value_states
            self._n = n + new
            self._view()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._n if self.is_initialized else 0

        def reset(self) -> None:
            self._k = self._v = None
            self._n = 0
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
            if tokens_to_remove == 0 or not self.is_initialized:
                return
            self._n = max(0, self._n + tokens_to_remove)
            self._view()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self._n > 0:
                self._k = self._k.repeat_interleave(repeats, dim=0)
                self._v = self._v.repeat_interleave(repeats, dim=0)
                self._view()

        def batch_select_indices(self, indices) -> None:
            if self._n > 0:
                self._k, self._v = self._k[indices], self._v[indices]
                self._view()

    return GrowingLayer


_GROWING = None


def preallocated_dynamic_cache(config, capacity: int):
    """An HF `DynamicCache` for `config` whose plain (full-attention) layers are preallocated for `capacity`
    positions and filled in place (`GrowingLayer` above); sliding-window and other layer kinds stay HF's."""
    global _GROWING
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if _GROWING is None:
        _GROWING = _growing_layer_class()
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = _GROWING(capacity)
    return cache
