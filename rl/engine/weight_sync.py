"""The policy's weights as (Hugging Face name, tensor) pairs, a module at a time: what a rollout engine
(vLLM colocated, or a vLLM server over a torch.distributed group) loads after each optimizer step.

    for name, tensor in policy_weights(pipeline.model):   # every rank under ZeRO-3 (collective)
        engine_loader(name, tensor)

What it handles, and why:
* Wrappers: DDP / DeepSpeed engines (`.module`), PPO's value-head model (`PPOModel.base_model`; the head
  is not the engine's), PEFT LoRA models (the names of the plain HF model, `base_model.model.` and
  `.base_layer` removed, adapters merged into the base weights for the duration of the iteration, as TRL
  syncs merged weights to vLLM; the adapters themselves are never sent).
* Tied embeddings: the embedding matrix is sent under both names, `model.embed_tokens.weight` and
  `lm_head.weight`, as the state dict lists it: vLLM's in-place reload counts a tied head as a layer of
  its own, and without its weight restores the head's old values ("ParallelLMHead: Failed to load
  weights"; measured: the engine's log-probs then matched neither the old nor the new policy).
* ZeRO-3: each module's own parameters are gathered (`deepspeed.zero.GatheredParameters`, every rank
  enters) and copied out one module at a time, so no rank holds more than one module's full weights
  beyond its shard; never the whole model at once (the most memory a colocated sync takes).
Names are yielded in `named_modules()` order, deterministic across ranks and runs.

Buckets (`pack_buckets` / `unpack_bucket`): the same pairs packed into flat byte buffers of at most
`bucket_bytes` (the `vllm_weight_sync_bucket_mb` key), so that a transfer is one message per bucket instead of
one (header, tensor) pair per tensor, as TRL's packed broadcast and verl's `update_weights_bucket_megabytes` do.
Each tensor keeps its dtype bit for bit (its bytes are copied, never cast); a tensor larger than a bucket
travels alone in a bucket of its own size. Under ZeRO-3 the tensors packed are `policy_weights`' gathered
copies (gathered a module at a time as above): a bucket fills with full tensors, never with partitions.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Iterable, Iterator

import torch

from rl.engine.dist import is_zero3, unwrap_module
from rl.engine.lora import lora_merged, lora_parent, merged_zero3


def policy_module(model) -> torch.nn.Module:
    """The causal LM inside `model`: engines and DDP unwrapped, PPO's value head left out (a PEFT model
    stays a PEFT model: `policy_weights` merges and renames its adapters)."""
    inner = unwrap_module(model)
    if type(inner).__name__ == "PPOModel":  # rl.models.value: the head is the trainer's, not the engine's
        inner = inner.base_model
    return inner


def hf_name(name: str) -> str | None:
    """A parameter name of a (PEFT-wrapped) model as the plain HF model names it; None for LoRA's own
    parameters (merged into the base weights, never sent)."""
    if ".lora_" in name or "original_module" in name:
        return None
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def policy_weights(model, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight of the policy's LM, a module at a time (see the module
    docstring). Under ZeRO-3 the tensors are copies; otherwise they are the parameters themselves, to be
    copied by the consumer before the iteration ends (a LoRA policy's are unmerged then). `merge_lora`
    False: a LoRA policy's base weights as they are (its adapters travel on their own: rl.rollout.vllm_lora)."""
    lm = policy_module(model)
    zero3 = is_zero3(lm)
    # merging under ZeRO-3 would need every rank's full weights at once; there the adapters are merged
    # per module below instead
    with (nullcontext() if zero3 or not merge_lora else lora_merged(lm)):
        for mod_name, module in lm.named_modules():
            own = list(module.named_parameters(recurse=False))
            if not own or ".lora_" in f".{mod_name}":
                continue  # LoRA's own matrices: merged into their base weight, never sent
            if zero3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                    items = [(n, p.detach().clone()) for n, p in own]
                parent = lora_parent(lm, mod_name) if merge_lora else None
                if parent is not None:
                    items = merged_zero3(parent, items)
            else:
                items = [(n, p.detach()) for n, p in own]
            for n, t in items:
                name = hf_name(f"{mod_name}.{n}" if mod_name else n)
                if name is not None:
                    yield name, t


# Offsets in a bucket are multiples of this, so that every tensor's bytes can be viewed as its dtype again
# (a view needs its offset to be a multiple of the element size) and start on a cache line.
ALIGN = 64


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in a bucket: its name, dtype, shape and byte offset."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclasses.dataclass
class Bucket:
    """Tensors packed into one flat contiguous uint8 buffer (on the tensors' device), and where each lies."""
    buffer: torch.Tensor
    metas: list[TensorMeta]

    def header(self) -> list:
        """The metadata as plain data (JSON), for a receiver that gets the buffer over a wire."""
        return [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape), m.offset] for m in self.metas]

    @classmethod
    def from_header(cls, header: list, buffer: torch.Tensor) -> "Bucket":
        return cls(buffer, [TensorMeta(n, getattr(torch, d), tuple(s), o) for n, d, s, o in header])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 reuse: bool = False) -> Iterator[Bucket]:
    """Pack (name, tensor) pairs, in order, into buckets of at most `bucket_bytes` bytes (offsets aligned to
    ALIGN); a tensor larger than `bucket_bytes` goes alone in a bucket of its own size. The bytes are copied
    as they are (no dtype conversion), so unpacking gives every tensor back bit for bit. Each tensor is copied
    in as it arrives, before the next pair is requested: `policy_weights` may change or free it after (a LoRA
    policy is unmerged when its iteration ends). `reuse`: every bucket fills the same memory, so a bucket (and
    its views) is valid only until the next one is requested; for a sender that is done with each bucket
    before it asks for the next (measured on CPU: fresh memory for each bucket cost ~4x the copy itself, in
    page faults)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buf, metas, used, spare = None, [], 0, None
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if buf is not None and (_aligned(used) + nbytes > buf.numel() or buf.device != t.device):
            yield Bucket(buf[:used], metas)
            spare = buf if reuse else None
            buf, metas, used = None, [], 0
        if buf is None:  # (pages of a CPU buffer that stay unused are never touched, so cost nothing)
            size = max(bucket_bytes, nbytes)
            fits = spare is not None and spare.numel() >= size and spare.device == t.device
            buf = spare if fits else torch.empty(size, dtype=torch.uint8, device=t.device)
        off = _aligned(used)
        if nbytes:
            buf[off:off + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        metas.append(TensorMeta(name, t.dtype, tuple(t.shape), off))
        used = off + nbytes
    if metas:
        yield Bucket(buf[:used], metas)


def unpack_bucket(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a bucket, each a view into its buffer (no copy), in packing order."""
    out = []
    for m in bucket.metas:
        raw = bucket.buffer[m.offset:m.offset + m.nbytes]
        out.append((m.name, raw.view(m.dtype).reshape(m.shape)))
    return out

