"""Batched sampling with per-token log-probs: the rollout function every RL trainer calls.

    from rl.engine.generation import generate
    out = generate(model, tokenizer, prompts=[[257, 72, 105], [257, 79]], max_new_tokens=32,
                   temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=None, stop_strings=None, seed=0)
    out.tokens     # (B, N) completion token ids, right-padded with the pad id
    out.logprobs   # (B, N) fp32 log-prob of each sampled token under the distribution it was drawn
                   #        from (after temperature / top-k / top-p), 0 where mask == 0
    out.mask       # (B, N) 1 for generated tokens (up to and including EOS / a stop token / the token
                   #        that completes a stop string), 0 after
    out.prompts    # the prompts (list of token lists), one per row (repeated when num_samples > 1)
    out.to_batch() # {"input_ids", "attention_mask", "labels", "old_logprobs"} for forward_backward:
                   # prompt left-padded + completion, labels -100 outside the completion,
                   # old_logprobs (B, T-1) aligned with labels[:, 1:]

`model` is a causal LM (plain, DDP, or a DeepSpeed engine; under ZeRO-3 call `generate` on every rank:
the parameters are gathered once per call and ZeRO's per-module hooks are removed while decoding, as
TRL does; pass the engine itself, e.g. `pipeline.model`, not the unwrapped module, or the hooks stay
and every rank must then run the same number of steps). `tokenizer_or_pad_id` is a tokenizer (gives
pad/eos and is required for stop strings) or just the pad id.

How it works, and why:
* A LoRA model samples with its adapters merged into the base weights (`lora_merged`): one matmul per
  linear layer instead of three. On CPU the linear layers compute with weights reordered once per
  rollout for oneDNN (`prepacked_linears`) rather than re-packed at every matmul.
* Prompts are left-padded, with an attention mask and position ids counted from each row's first real
  token (what HF `generate` does), so a row's tokens do not depend on the other rows.
* One prefill with `logits_to_keep=1` (no (B, P, V) logits), then one token per step with a KV cache.
* The G samples of a prompt share one prefill (`share_prefill`): the prompt's KV cache is computed
  once and repeated G times, so a GRPO step prefills prompts, not prompts x G.
* Finished rows leave the decode batch (dynamic cache; `drop_finished`): with uneven completion
  lengths the cost is the tokens generated rather than rows x the longest row, which is what HF
  `generate` (and so TRL) computes. Measured on the tiny model, 64 rows of geometric lengths (2,518
  tokens, longest 151), 1 CPU thread: 1.3 -> 0.74 CPU s (bench/README.md, GRPO with uneven lengths).
* Sampling is inverse-CDF with one uniform per row and step, a pure function of (seed, row, step)
  (`rl.engine.scoring.sample_tokens`): row r of a call with `seed=s` draws from seed `s + r`. Seeded
  runs repeat exactly, a row samples the same tokens whatever else is in the batch (so batched ==
  one-by-one with seed s + r), and nothing reads the global RNG. `seed=None` takes a base seed from
  torch's global generator.
* `temperature=0` is greedy; its log-probs are then those of the untempered model (a point mass
  would give 0 everywhere, useless as old log-probs).
* `cache="static"` uses a preallocated `StaticCache` and fixed tensor shapes; `compile=True` (CUDA
  only) additionally compiles the decode step with CUDA graphs: the path measured at ~14-18k new
  tokens/s on an H200 for a 0.5B model (shared/bench/decode_probe.py) against ~1k for `generate`.

The reference's one-prompt `sample` (`ForwardBackwardPipeline.sample`) is `generate` plus
`split_stop` (its mixed stop list), `config_pad_eos` (pad/EOS without a tokenizer) and
`Rollout.sample_dict` (its result dict). Scoring given tokens is `rl.engine.scoring.sequence_logprobs`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from rl.engine.dist import is_zero3, unwrap_module
from rl.engine.fast_decode import PREPACK_MIN_NEW_TOKENS, preallocated_dynamic_cache, prepacked_linears
from rl.engine.host_memory import keep_freed_memory
from rl.engine.lora import lora_merged
from rl.engine.losses import IGNORE_INDEX
from rl.engine.packing import left_pad, position_ids_from_mask
from rl.engine.scoring import sample_tokens


@dataclass
class Rollout:
    """Output of `generate`. B = rows (prompts x num_samples), P = padded prompt length, N = new tokens."""

    tokens: torch.Tensor  # (B, N) long, pad where mask == 0
    logprobs: torch.Tensor  # (B, N) float32, 0 where mask == 0
    mask: torch.Tensor  # (B, N) long
    prompts: list[list[int]]  # B prompts as token lists
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    pad_token_id: int = 0
    finish_reasons: list[str] = field(default_factory=list)  # "stop" or "length" per row

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)

    def completions(self) -> list[list[int]]:
        """The generated tokens of each row, without padding."""
        return [t[m.bool()].tolist() for t, m in zip(self.tokens.cpu(), self.mask.cpu())]

    def to_batch(self) -> dict[str, torch.Tensor]:
        """Prompt + completion as one left/right-padded batch, ready for `forward_backward`.

        input_ids/attention_mask/labels are (B, P+N); old_logprobs is (B, P+N-1), aligned with
        labels[:, 1:] (the sampled tokens' log-probs at the completion positions, 0 elsewhere)."""
        input_ids = torch.cat([self.prompt_ids, self.tokens], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.mask], dim=1)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        P = self.prompt_ids.shape[1]
        labels[:, P:] = self.tokens.masked_fill(self.mask == 0, IGNORE_INDEX)
        old = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.float32,
                          device=input_ids.device)
        old[:, P - 1:] = self.logprobs
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "old_logprobs": old}

    def sample_dict(self, flat: bool = False) -> dict:
        """The reference's `sample` result of a one-prompt rollout: `tokens` and `logprobs` of each
        row (without padding), `prompt`, `finish_reason` of each row; `flat`: the first row's values
        instead of lists of rows (one sample)."""
        toks, n = self.completions(), self.mask.sum(-1).tolist()
        lps = [self.logprobs[i, :n[i]].tolist() for i in range(len(toks))]
        if flat:
            return {"tokens": toks[0], "logprobs": lps[0], "prompt": self.prompts[0],
                    "finish_reason": self.finish_reasons[0]}
        return {"tokens": toks, "logprobs": lps, "prompt": self.prompts[0], "finish_reason": self.finish_reasons}


def split_stop(stop) -> tuple[list[int], list[str] | None]:
    """The reference's `stop`, token ids and strings mixed, as `generate`'s (stop_token_ids, stop_strings)."""
    stop = list(stop or [])
    strings = [s for s in stop if isinstance(s, str)]
    return [int(s) for s in stop if not isinstance(s, str)], strings or None


def config_pad_eos(model) -> tuple[int, int | list[int] | None]:
    """(pad id, EOS id(s)) from a model's config, for sampling without a tokenizer: the config's pad
    id, else its EOS id when it is one int, else 0."""
    cfg = getattr(model, "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    eos = getattr(cfg, "eos_token_id", None)
    return (pad if pad is not None else (eos if isinstance(eos, int) else 0)), eos


# ------------------------------------------------------------------------------------ model plumbing

@contextmanager
def gathered_for_generation(model):
    """Yield the plain HF module with full parameters for the duration of a rollout.

    Under ZeRO-3 the parameters are gathered once (collective: every rank must enter) and the
    engine's per-module hooks are removed, so decoding does no communication per token (and ranks
    may stop after different numbers of steps); hooks are restored on exit."""
    inner = unwrap_module(model)
    if not is_zero3(inner):
        with lora_merged(inner):
            yield inner
        return
    import deepspeed

    offload = _zero_offload(model)
    if offload is not None:
        for p in inner.parameters():
            p.ds_active_sub_modules.clear()
        for h in offload.forward_hooks + offload.backward_hooks:
            h.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
    try:
        with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None):
            yield inner
    finally:
        if offload is not None:
            coord = getattr(offload, "param_coordinator", None)
            if coord is not None and not coord.is_invalid_trace():
                coord._invalidate_trace()
            offload._register_deepspeed_module(offload.module)


def _zero_offload(model):
    """The object holding a ZeRO-3 engine's parameter hooks (None if `model` is not an engine)."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return None
    opt = getattr(opt, "parameter_offload", opt)
    return opt if hasattr(opt, "forward_hooks") else None


def _cache_kwarg(model) -> str:
    """The KV-cache keyword of the model's own forward ("cache" replaced "past_key_values", which now warns).
    A PEFT model's forward takes **kwargs and passes them on, so its base model's signature decides."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _resolve_ids(tokenizer_or_pad_id, eos_token_id):
    if isinstance(tokenizer_or_pad_id, int):
        return None, tokenizer_or_pad_id, eos_token_id
    tok = tokenizer_or_pad_id
    eos = tok.eos_token_id if eos_token_id is None else eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; pass the pad id instead")
    return tok, pad, eos


def _as_prompt_list(prompts) -> list[list[int]]:
    if torch.is_tensor(prompts):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    out = [list(map(int, p.tolist() if torch.is_tensor(p) else p)) for p in prompts]
    return out


# ------------------------------------------------------------------------------------ the rollout

@torch.no_grad()
def generate(model, tokenizer_or_pad_id, prompts, max_new_tokens: int = 64, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, stop_token_ids=None, stop_strings=None,
             seed: int | None = None, *, num_samples: int = 1, eos_token_id=None, cache: str = "dynamic",
             compile: bool = False, sync_every: int = 8, drop_finished: bool = True,
             share_prefill: bool = True, dtype: torch.dtype | str | None = None) -> Rollout:
    """Sample `max_new_tokens` (at most) after each prompt; see the module docstring.

    Args:
        prompts: list of token lists (or a (B, P) tensor without padding, or one 1-D tensor).
        stop_token_ids: extra ids that end a row (EOS always does, when known); the stop token is
            part of the completion (mask 1).
        stop_strings: strings that end a row once the decoded completion contains one (needs a
            tokenizer); the token completing it is the last one kept.
        num_samples: completions per prompt; rows are prompt-major (p0 s0, p0 s1, ..., p1 s0, ...).
        cache: "dynamic" (HF DynamicCache) or "static" (preallocated, fixed shapes).
        compile: CUDA only; compile the decode step (static cache, CUDA graphs).
        sync_every: on CUDA, check "all rows finished" every this many steps (each check syncs).
        drop_finished: with the dynamic cache, remove finished rows from the decode batch (and their
            KV cache) at each check, so that uneven completion lengths cost the tokens generated, not
            rows x the longest row; the other rows' tokens and log-probs do not change (each row's
            computation and noise are its own). False keeps every row to the end, as HF `generate` does.
        share_prefill: with num_samples > 1 and the dynamic cache, run the prefill once per distinct
            prompt and repeat its KV cache num_samples times (a GRPO group's G completions share their
            prompt), instead of G identical prefills; the outputs are the same (each row's noise is its
            own), up to float rounding of a batch of another size.
        dtype: the linear layers' compute dtype while sampling (None: the model's; a name such as
            "bfloat16" is torch's). torch.bfloat16 on a CPU: bf16 copies of the weights for this call
            (`prepacked_linears`); on a GPU: autocast. The log-probs are then the bf16 model's, not the
            fp32 policy's (GRPO's `rollout_dtype`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if cache not in ("dynamic", "static"):
        raise ValueError(f"cache must be 'dynamic' or 'static', got {cache!r}")
    if compile and not torch.cuda.is_available():
        raise ValueError("compile=True needs CUDA (CUDA graphs); use compile=False on CPU")
    if compile and cache != "static":
        raise ValueError("compile=True needs cache='static' (fixed shapes); pass both")
    tok, pad_id, eos = _resolve_ids(tokenizer_or_pad_id, eos_token_id)
    if stop_strings and tok is None:
        raise ValueError("stop_strings need a tokenizer: pass the tokenizer instead of a pad id")
    stop_ids = set(int(i) for i in (stop_token_ids or []))
    if eos is not None:
        stop_ids |= set([eos] if isinstance(eos, int) else eos)
    prompts = [p for p in _as_prompt_list(prompts) for _ in range(num_samples)]
    if seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())

    with gathered_for_generation(model) as lm:
        device = next(lm.parameters()).device
        ids, pmask = left_pad(prompts, pad_id, device)
        was_training = lm.training
        lm.eval()
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.float32)
        low = dtype != torch.float32
        if device.type == "cpu":  # the (rows, V) logits and the sampler's temporaries: rl.engine.host_memory
            keep_freed_memory()
        if device.type == "cpu" and (max_new_tokens >= PREPACK_MIN_NEW_TOKENS or low):
            precision = prepacked_linears(lm, len(prompts), dtype)
        else:
            precision = torch.autocast(device.type, dtype=dtype) if low else nullcontext()
        try:
            with precision:
                tokens, logps, gmask, reasons = _decode(lm, ids, pmask, prompts, max_new_tokens, temperature,
                                                        top_k, top_p, stop_ids, stop_strings, tok, seed, cache,
                                                        compile, sync_every, drop_finished,
                                                        num_samples if share_prefill else 1)
        finally:
            lm.train(was_training)
    tokens = tokens.masked_fill(gmask == 0, pad_id)
    return Rollout(tokens=tokens, logprobs=logps * gmask, mask=gmask, prompts=prompts, prompt_ids=ids,
                   prompt_mask=pmask, pad_token_id=pad_id, finish_reasons=reasons)


def _decode(lm, ids, pmask, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, stop_strings,
            tok, seed, cache_kind, compile, sync_every, drop_finished=True, group=1):
    """The decoding loop. Outputs are (B, N) in the caller's row order; the model runs on the rows in
    `live` (original indices still decoding): all B, or with `drop_finished` the unfinished ones, the
    KV cache and attention mask compacted with them (`DynamicCache.batch_select_indices`). `group` > 1:
    rows come in runs of `group` copies of one prompt; the prefill runs on one row of each run and its
    cache is repeated (`DynamicCache.batch_repeat_interleave`)."""
    B, P = ids.shape
    device = ids.device
    row_seeds = torch.arange(B, device=device, dtype=torch.int64) + int(seed)
    stop_t = torch.tensor(sorted(stop_ids), device=device, dtype=torch.long) if stop_ids else None
    total = P + max_new_tokens
    cache = _make_cache(lm, cache_kind, B, total)
    ckw = _cache_kwarg(lm)
    # the full-length mask: fixed shape (the static cache / compiled step need it), grows in place
    amask = torch.zeros(B, total, dtype=torch.long, device=device)
    amask[:, :P] = pmask
    positions = position_ids_from_mask(pmask)
    static = cache_kind == "static"
    # fixed shapes (static cache, CUDA graphs) cannot shrink; a cache without batch selection neither
    compact = drop_finished and not static and not compile and hasattr(cache, "batch_select_indices")

    def forward(step_ids, m, pos):
        return lm(input_ids=step_ids, attention_mask=m, position_ids=pos, use_cache=True,
                  logits_to_keep=1, **{ckw: cache}).logits[:, -1]

    def step_fn(step_ids, pos, end, step):
        # amask and row_seeds are read from the enclosing scope: compaction rebinds them
        logits = forward(step_ids, amask if static else amask[:, :end], pos)
        return sample_tokens(logits, row_seeds, step, temperature, top_k, top_p)

    decode_fn = step_fn
    if compile:
        # only tensors cross the compiled boundary (a changing Python int would recompile)
        compiled = torch.compile(lambda s_ids, pos, step_t: step_fn(s_ids, pos, total, step_t),
                                 mode="reduce-overhead", fullgraph=False)

    out_tok = torch.full((B, max_new_tokens), 0, dtype=torch.long, device=device)
    out_lp = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    out_mask = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    next_pos = pmask.sum(-1)  # position of the first generated token, per row
    live = torch.arange(B, device=device)  # the original rows in the decode batch, in its order
    reasons = ["length"] * B
    max_stop = max((len(s) for s in stop_strings), default=0) if stop_strings else 0
    check_every = sync_every if device.type == "cuda" else 1

    # prefill (never compiled); a shared one needs a cache that can repeat its rows
    if group > 1 and not static and hasattr(cache, "batch_repeat_interleave") and B % group == 0:
        first = slice(None, None, group)
        logits = forward(ids[first], amask[first, :P], positions[first]).repeat_interleave(group, dim=0)
        cache.batch_repeat_interleave(group)
        cur = sample_tokens(logits, row_seeds, 0, temperature, top_k, top_p)
    else:
        cur = step_fn(ids, positions, P, 0)
    for t in range(max_new_tokens):
        tok_t, lp_t = cur  # (b,) for the rows `live`
        alive = ~finished[live]
        out_tok[live, t] = torch.where(alive, tok_t, torch.zeros_like(tok_t))
        out_lp[live, t] = lp_t
        out_mask[live, t] = alive.long()
        if stop_t is not None:
            finished[live] = finished[live] | (alive & torch.isin(tok_t, stop_t))
        if stop_strings:
            finished = _check_stop_strings(tok, out_tok, out_mask, t, finished, stop_strings, max_stop, reasons)
        if t + 1 == max_new_tokens:
            break
        if (t + 1) % check_every == 0:
            if bool(finished.all()):
                break
            if compact:
                keep = (~finished[live]).nonzero().squeeze(1)
                if keep.numel() < live.numel():
                    # rows that finished before this step (alive False) or at it: out of the batch
                    cache.batch_select_indices(keep)
                    live, amask, row_seeds = live[keep], amask[keep], row_seeds[keep]
                    tok_t, alive = tok_t[keep], alive[keep]
        amask[:, P + t] = alive.long()  # the token just written is attended by later steps
        step_ids = torch.where(alive, tok_t, torch.full_like(tok_t, 0))[:, None]
        pos = (next_pos[live] + t)[:, None]
        if compile:
            torch.compiler.cudagraph_mark_step_begin()
            # a CUDA-graph output is overwritten by the next replay: clone before keeping it
            step_t = torch.tensor(t + 1, device=device)
            cur = tuple(x.clone() for x in compiled(step_ids, pos, step_t))
        else:
            cur = decode_fn(step_ids, pos, P + t + 1, t + 1)
    for i in range(B):
        n = int(out_mask[i].sum())
        if reasons[i] == "length" and n > 0 and int(out_tok[i, n - 1]) in stop_ids:
            reasons[i] = "stop"
    return out_tok, out_lp, out_mask, reasons


def _make_cache(lm, kind, batch, total):
    from transformers import StaticCache

    if kind == "static":
        return StaticCache(config=lm.config, max_cache_len=total)
    return preallocated_dynamic_cache(lm.config, total)


def _check_stop_strings(tok, out_tok, out_mask, t, finished, stop_strings, max_stop, reasons):
    """Finish rows whose completion now contains a stop string (only the tail is decoded: every
    token decodes to at least one character, so the last len(stop)+2 tokens suffice)."""
    lo = max(0, t + 1 - (max_stop + 2))
    tail = out_tok[:, lo:t + 1].tolist()
    live = out_mask[:, t].tolist()
    fin = finished.clone()
    for i, row in enumerate(tail):
        if not live[i] or fin[i]:
            continue
        text = tok.decode(row, skip_special_tokens=True)
        if any(s in text for s in stop_strings):
            fin[i] = True
            reasons[i] = "stop"
    return fin
