"""Scoring tokens: the per-step sampling distribution `generate` draws from, and no-grad log-probs
of given tokens.

Sampling one step (`sample_tokens`), as `rl.engine.generation.generate` calls it:
* `process_logits`: temperature, then top-k, then top-p (nucleus, Holtzman et al. 2019), in HF's
  order; at least one token always survives. The log-probs reported are those of this distribution.
* Inverse-CDF sampling: the token is where one uniform u per row and step falls in the row's
  cumulative distribution (float64, so a 50k-token vocabulary's tail keeps its resolution). u comes
  from `hashed_uniform`, a counter-based hash (murmur3's finaliser) of (row seed, step): no generator
  state, each row's draw independent of the batch it is in, nothing read from the global RNG. (The
  former Gumbel-max drew a hashed uniform per vocabulary entry: on SmolLM2's 49,152-token vocabulary
  at 16 rows that cost ~145 ms of CPU per decode step, more than the model's forward; one draw per
  row costs a cumulative sum.)
* `temperature=0` is greedy; its log-probs are then those of the untempered model (a point mass
  would give 0 everywhere, useless as old log-probs).

Scoring given tokens, with the LM head chunked (`rl.engine.chunked`) so the (B, T, V) logits never
exist when `chunk_size` is set or they would be large:
* `sequence_logprobs(model, input_ids, attention_mask, labels, chunk_size)`: per-token log-probs
  (B, T-1), position ids counted from each row's first attended token (exact for either padding side).
* `sequence_logps`: per-sequence sums of answer-token log-probs and their counts, for padded rows or
  packed ones (`sequence_index`); `concatenated_logps`: those of a DPO batch's chosen and rejected
  halves, padded or packed.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from rl.engine import losses, segments
from rl.engine.chunked import (
    auto_capture_head,
    auto_chunk_size,
    capture_head,
    head_vocab,
    output_head,
)
from rl.engine.dist import unwrap_module
from rl.engine.losses import IGNORE_INDEX, token_logprobs
from rl.engine.packing import position_ids_from_mask, segment_sum

_M32 = 0xFFFFFFFF


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   ) -> torch.Tensor:
    """(B, V) logits -> fp32 logits of the sampling distribution (filtered entries are -inf).

    Order as in HF: temperature, then top-k, then top-p (nucleus, Holtzman et al. 2019); at least
    one token always survives."""
    logits = logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def hashed_uniform(row_seeds: torch.Tensor, step: int | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) uniforms in (0, 1), a pure function of (row seed, step, token id).

    A counter-based hash (murmur3's finaliser on 32-bit words, computed in int64), so sampling needs
    no generator state and each row's noise is independent of the batch it is in."""
    dev = row_seeds.device
    v = torch.arange(vocab_size, device=dev, dtype=torch.int64)
    x = (row_seeds.to(torch.int64)[:, None] * 0x9E3779B1 + v[None] * 0x85EBCA77
         + (torch.as_tensor(step, device=dev, dtype=torch.int64) + 1) * 0xC2B2AE3D) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    x = x ^ (x >> 16)
    x = ((x ^ (row_seeds.to(torch.int64)[:, None] >> 32)) * 0x9E3779B1) & _M32  # high seed bits
    x = x ^ (x >> 16)
    return ((x >> 8).float() + 0.5) / float(1 << 24)


def sample_tokens(logits: torch.Tensor, row_seeds: torch.Tensor, step, temperature: float, top_k: int,
                  top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: (B, V) raw logits -> (B,) tokens and (B,) their log-probs under the
    sampling distribution. Inverse CDF: the first token whose cumulative probability exceeds u * total,
    u uniform in (0, 1) per row (48 bits from two hashed 24-bit words); a token of probability 0 (cut
    by top-k / top-p) spans an empty interval and is never drawn."""
    if not temperature:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)
    cdf = logp.exp().double().cumsum(-1)  # exp in fp32 (2x cheaper than fp64), the sum in fp64
    words = hashed_uniform(row_seeds, step, 2).double()  # (B, 2), each (k + 0.5) / 2**24
    u = (torch.floor(words[:, :1] * (1 << 24)) + words[:, 1:]) / float(1 << 24)
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


# ------------------------------------------------------------------------------------ scoring

@torch.no_grad()
def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      labels: torch.Tensor | None = None, chunk_size: int | None = None,
                      position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                      model_inputs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad per-token log-probs (B, T-1) of `labels` (default: the inputs where attended) and
    their mask, like `rl.engine.losses.token_logprobs(model(...).logits / temperature, labels)`.

    The LM head + log-softmax run over `chunk_size` positions at a time (default: automatically
    once B*T*V exceeds `rl.engine.chunked.AUTO_MIN_ELEMENTS`), so neither the (B, T, V) logits nor their
    fp32 copy exist at once: the peak drops from ~2 x B*T*V floats to ~B*chunk*V. The model's own
    forward runs (`rl.engine.chunked.capture_head`), so its final norm, soft-capping and scaling apply as
    they do in the full path. Falls back to chunking only the log-softmax when the model has no
    separate head module. `model_inputs`: the keyword inputs of a packed row (position ids and
    `rl.engine.segments`' boundaries); the model then gets no attention mask, as in training."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if labels is None:
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    lm = unwrap_module(model)
    head = output_head(lm)
    if head is not None:
        chunk_size = auto_chunk_size(input_ids.shape[0], input_ids.shape[1], head_vocab(head), chunk_size)
    chunk_size = chunk_size or None  # 0: never chunk
    with capture_head(lm, chunk_size) if (chunk_size and head is not None) else nullcontext():
        inputs = model_inputs or {"attention_mask": attention_mask, "position_ids": position_ids}
        logits = lm(input_ids=input_ids, use_cache=False, **inputs).logits
    if temperature and temperature != 1.0:
        logits = logits / temperature
    return token_logprobs(logits, labels, chunk_size=chunk_size)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_index: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of answer-token log-probs and number of answer tokens per sequence.

    logits (N, T, V), labels (N, T) with -100 on prompt and padding (HF convention, shifted inside).
    Returns (logps (N,), lengths (N,)) in fp32. Packed rows (`rl.data.preference.pack_pairs`) give
    `sequence_index` (R, T): the sums then run over each sequence's tokens, wherever its rows put them,
    (S,) for the S sequences (S = max index + 1).
    """
    logp, mask = losses.token_logprobs(logits, labels)
    if sequence_index is None:
        return logp.sum(-1), mask.sum(-1)
    # the target at position t+1 is predicted at t and belongs to the sequence of token t+1
    target_seq = sequence_index[:, 1:].to(logp.device)
    n = int(sequence_index.max()) + 1
    return segment_sum(logp, target_seq, n), segment_sum(mask, target_seq, n)


@torch.no_grad()
def concatenated_logps(model, batch: dict[str, torch.Tensor], chunk_size: int | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """No-grad forward of a collated batch -> (chosen_logps, rejected_logps, chosen_lengths,
    rejected_lengths), each (B,). Passes position_ids, so it is exact for either padding side. The LM
    head runs over `chunk_size` positions at a time (automatically when the logits would be large;
    see `sequence_logprobs`), so no (2B, T, V) logits."""
    device = next(iter(batch.values())).device
    if "sequence_index" in batch:  # packed rows (pack_pairs)
        logps, lengths = _packed_logps(model, {k: v.to(device) for k, v in batch.items()}, chunk_size)
    else:
        ids, mask, pos = (batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids"))
        labels = batch["labels"].to(device)
        logp, m = sequence_logprobs(model, ids, mask, labels, chunk_size=chunk_size, position_ids=pos)
        logps, lengths = logp.sum(-1), m.sum(-1)
    c, r = logps.chunk(2)
    cl, rl = lengths.chunk(2)
    return c, r, cl, rl


def _packed_logps(model, batch: dict[str, torch.Tensor], chunk_size: int | None):
    """`sequence_logps` of packed rows under `model`, its LM head chunked as in `sequence_logprobs`:
    the forward gets position_ids, no mask and no cache (so transformers builds the block-diagonal
    mask, `rl.engine.packing`)."""
    lm = unwrap_module(model)
    ids = batch["input_ids"]
    inputs = {"position_ids": batch["position_ids"]}
    if "prefix_of" in batch:  # shared prompts (pack_pairs_shared): answers attend to their prompt's segment
        if not segments.enable(lm):
            raise ValueError("shared-prompt rows need SDPA attention (rl.engine.segments); this model's is "
                             f"{getattr(getattr(lm, 'config', None), '_attn_implementation', None)!r}")
        inputs = segments.shared_prefix_inputs(batch)
    with auto_capture_head(lm, ids, chunk_size):
        logits = lm(input_ids=ids, use_cache=False, **inputs).logits
    return sequence_logps(logits, batch["labels"], batch["sequence_index"])
