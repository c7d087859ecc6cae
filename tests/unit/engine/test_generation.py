"""Batched rollouts: log-probs, left padding, seeding, stop conditions, caches, chunked scoring."""

from __future__ import annotations

import warnings

import pytest
import torch

from rl.engine.generation import Rollout, generate
from rl.engine.losses import token_logprobs
from rl.engine.packing import left_pad, position_ids_from_mask
from rl.engine.scoring import hashed_uniform, process_logits, sample_tokens, sequence_logprobs

EOS = 258


@pytest.fixture(scope="module")
def lm(tiny_llama):
    from rl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_llama, dtype="float32")
    model.eval()
    return model


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.encode(t) for t in ("hello world", "hi", "the quick fox")]


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], 0)


def test_process_logits_top_k_top_p_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = process_logits(logits, top_k=2)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    # nucleus 0.7: 0.5 alone is below, 0.5+0.3 reaches it -> keep two
    p = process_logits(logits, top_p=0.7)
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    p = process_logits(logits, top_p=0.01)  # the top token always survives
    assert torch.isfinite(p[0, 0]) and torch.isinf(p[0, 1:]).all()
    t = process_logits(logits, temperature=0.5)
    assert torch.allclose(t, logits * 2)


def test_hashed_uniform_is_uniform_and_row_independent():
    u = hashed_uniform(torch.tensor([3, 4]), 7, 50000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    alone = hashed_uniform(torch.tensor([4]), 7, 50000)
    assert torch.equal(u[1:], alone)
    assert not torch.equal(u, hashed_uniform(torch.tensor([3, 4]), 8, 50000))


@pytest.mark.parametrize("filters", [dict(), dict(top_k=3), dict(top_p=0.8, temperature=0.5)])
def test_sample_tokens_draws_from_the_sampling_distribution(filters):
    """40,000 rows (seeds) of one logits vector: each token's frequency is within 4.5 standard errors of
    its probability under the filtered distribution, cut tokens are never drawn, and the returned
    log-probs are those of the drawn tokens."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01])
    n = 40_000
    logits = torch.log(probs).expand(n, -1)
    kw = dict(temperature=1.0, top_k=0, top_p=1.0) | filters
    tok, lp = sample_tokens(logits, torch.arange(n) * 7919 + 3, 5, **kw)
    target = torch.softmax(process_logits(logits[:1], **kw), -1)[0]
    freq = torch.bincount(tok, minlength=len(probs)).double() / n
    se = (target.double() * (1 - target.double()) / n).sqrt()
    assert ((freq - target).abs() <= 4.5 * se + 1e-12).all(), (freq, target)
    assert (freq[target == 0] == 0).all()
    assert torch.allclose(lp, torch.log(target)[tok], atol=1e-6)


def test_sampled_logprobs_equal_a_later_forward(lm, prompts):
    out = generate(lm, 256, prompts, max_new_tokens=16, temperature=1.0, seed=11, eos_token_id=EOS)
    batch = out.to_batch()
    logits = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=position_ids_from_mask(batch["attention_mask"])).logits
    logp, mask = token_logprobs(logits, batch["labels"])
    assert torch.equal(mask.bool(), batch["labels"][:, 1:] != -100)
    assert torch.allclose(logp, batch["old_logprobs"] * mask, atol=1e-4)
    assert out.mask.sum() > 0 and (out.logprobs[out.mask.bool()] < 0).all()


def test_logprobs_are_of_the_filtered_distribution(lm, prompts):
    out = generate(lm, 256, prompts[:1], max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9, seed=2)
    ids = torch.cat([out.prompt_ids, out.tokens], 1)
    logits = lm(input_ids=ids).logits[0, out.prompt_ids.shape[1] - 1:-1]
    filtered = torch.log_softmax(process_logits(logits, 0.7, 5, 0.9), -1)
    want = filtered.gather(-1, out.tokens[0, :, None]).squeeze(-1)
    n = int(out.mask.sum())
    assert torch.allclose(out.logprobs[0, :n], want[:n], atol=1e-4)
    assert torch.isfinite(want[:n]).all()  # every sampled token survived top-k / top-p


def test_batched_left_padded_equals_one_by_one(lm, prompts):
    batched = generate(lm, 256, prompts, max_new_tokens=12, seed=5, eos_token_id=EOS)
    assert batched.prompt_mask[1].tolist()[:2] == [0, 0]  # really left-padded
    for r, p in enumerate(prompts):
        single = generate(lm, 256, [p], max_new_tokens=12, seed=5 + r, eos_token_id=EOS)
        n = int(single.mask.sum())
        assert batched.completions()[r] == single.completions()[0]
        assert torch.allclose(batched.logprobs[r, :n], single.logprobs[0, :n], atol=1e-4)


def test_seeded_runs_repeat_and_seeds_differ(lm, prompts):
    a = generate(lm, 256, prompts, max_new_tokens=10, seed=1)
    b = generate(lm, 256, prompts, max_new_tokens=10, seed=1)
    c = generate(lm, 256, prompts, max_new_tokens=10, seed=2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    torch.manual_seed(0)
    d = generate(lm, 256, prompts, max_new_tokens=10)
    torch.manual_seed(0)
    e = generate(lm, 256, prompts, max_new_tokens=10)
    assert torch.equal(d.tokens, e.tokens)


def test_greedy_matches_hf_generate_with_left_padding(lm, prompts):
    out = generate(lm, 256, prompts, max_new_tokens=8, temperature=0, eos_token_id=None)
    ids, mask = left_pad(prompts, 256)
    ref = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                      pad_token_id=256, eos_token_id=None)
    assert out.tokens.tolist() == ref[:, ids.shape[1]:].tolist()


def test_static_cache_equals_dynamic(lm, prompts):
    a = generate(lm, 256, prompts, max_new_tokens=10, seed=3, cache="dynamic")
    b = generate(lm, 256, prompts, max_new_tokens=10, seed=3, cache="static")
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


class _EOSAtPosition(torch.nn.Module):
    """Wraps an LM so that EOS wins once the query position reaches `at` (per row)."""

    def __init__(self, lm, at):
        super().__init__()
        self.lm, self.at, self.config = lm, at, lm.config

    def forward(self, input_ids=None, position_ids=None, cache=None, **kw):
        out = self.lm(input_ids=input_ids, position_ids=position_ids, cache=cache, **kw)
        pos = position_ids[:, -out.logits.shape[1]:]
        out.logits[..., EOS] += 1e4 * (pos >= self.at).float()
        return out


def test_stops_on_eos_per_row(lm, prompts, tiny_tokenizer):
    wrapped = _EOSAtPosition(lm, at=5)
    out = generate(wrapped, tiny_tokenizer, prompts, max_new_tokens=20, seed=0)  # EOS from the tokenizer
    for r, p in enumerate(prompts):
        # token j is predicted at position len(p) - 1 + j; EOS from position 5 on
        n = max(0, 6 - len(p)) + 1
        assert int(out.mask[r].sum()) == n, (r, out.mask[r])
        assert int(out.tokens[r, n - 1]) == EOS and out.finish_reasons[r] == "stop"
        assert (out.tokens[r, n:] == tiny_tokenizer.pad_token_id).all() and (out.logprobs[r, n:] == 0).all()
    # extra stop ids work the same way, and a row that never stops reports "length" (EOS switched off
    # with eos_token_id=-1: a random model's greedy path may well reach EOS within 6 tokens)
    out = generate(lm, tiny_tokenizer, prompts[:1], max_new_tokens=6, temperature=0, eos_token_id=-1)
    first = int(out.tokens[0, 2])
    stopped = generate(lm, tiny_tokenizer, prompts[:1], max_new_tokens=6, temperature=0, eos_token_id=-1,
                       stop_token_ids=[first])
    k = out.tokens[0].tolist().index(first) + 1
    assert stopped.completions()[0] == out.tokens[0, :k].tolist()
    assert out.finish_reasons == ["length"]


class _Scripted(torch.nn.Module):
    """Wraps an LM so that its j-th new token is `script[j]` whatever the sampler draws: the text a
    test stops on is then known in advance, on every CPU (a random model's own greedy text is not)."""

    def __init__(self, lm, script, prompt_len):
        super().__init__()
        self.lm, self.script, self.prompt_len, self.config = lm, script, prompt_len, lm.config

    def forward(self, input_ids=None, position_ids=None, cache=None, **kw):
        out = self.lm(input_ids=input_ids, position_ids=position_ids, cache=cache, **kw)
        pos = position_ids[:, -out.logits.shape[1]:]  # token j is predicted at position prompt_len - 1 + j
        for j, tok in enumerate(self.script):
            out.logits[..., tok] += 1e4 * (pos == self.prompt_len - 1 + j).float()
        return out


def test_stop_strings(lm, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("abc")
    script = tiny_tokenizer.encode("xy, the end. more", add_special_tokens=False)
    scripted = _Scripted(lm, script, len(prompt))
    full = generate(scripted, tiny_tokenizer, [prompt], max_new_tokens=len(script), seed=0, eos_token_id=-1)
    assert full.completions()[0] == script and full.finish_reasons == ["length"]
    out = generate(scripted, tiny_tokenizer, [prompt], max_new_tokens=len(script), seed=0, eos_token_id=-1,
                   stop_strings=["the end"])
    k = len(tiny_tokenizer.encode("xy, the end", add_special_tokens=False))  # stops on the string's last token
    assert out.completions()[0] == script[:k] and out.finish_reasons == ["stop"]
    with pytest.raises(ValueError, match="tokenizer"):
        generate(lm, 256, [prompt], max_new_tokens=2, stop_strings=["x"])


def test_num_samples_rows_are_prompt_major(lm, prompts):
    out = generate(lm, 256, prompts[:2], max_new_tokens=8, num_samples=3, seed=0)
    assert isinstance(out, Rollout) and out.tokens.shape[0] == 6
    assert out.prompts == [prompts[0]] * 3 + [prompts[1]] * 3
    assert len({tuple(c) for c in out.completions()[:3]}) == 3  # distinct samples of one prompt


def test_chunked_sequence_logprobs_equal_full(lm, prompts):
    out = generate(lm, 256, prompts, max_new_tokens=8, seed=0)
    b = out.to_batch()
    full, m1 = sequence_logprobs(lm, b["input_ids"], b["attention_mask"], b["labels"])
    chunked, m2 = sequence_logprobs(lm, b["input_ids"], b["attention_mask"], b["labels"], chunk_size=3)
    assert torch.equal(m1, m2) and torch.allclose(full, chunked, atol=1e-5)
    assert torch.allclose(full, b["old_logprobs"] * m1, atol=1e-4)


def test_left_padding_with_absolute_positions_gpt2(tiny_cache, prompts):
    """GPT-2 has absolute position embeddings: wrong position ids under left padding would change
    every token, so this checks them (RoPE models are shift-invariant)."""
    from rl.models.loading import load_causal_lm
    from rl.models.tiny import write_tiny_model

    gpt2 = load_causal_lm(str(write_tiny_model(tiny_cache / "gpt2", family="gpt2")), dtype="float32").eval()
    batched = generate(gpt2, 256, prompts, max_new_tokens=8, seed=9, eos_token_id=EOS)
    for r, p in enumerate(prompts):
        single = generate(gpt2, 256, [p], max_new_tokens=8, seed=9 + r, eos_token_id=EOS)
        n = int(single.mask.sum())
        assert batched.completions()[r] == single.completions()[0]
        assert torch.allclose(batched.logprobs[r, :n], single.logprobs[0, :n], atol=1e-4)
    b = batched.to_batch()
    lp, m = sequence_logprobs(gpt2, b["input_ids"], b["attention_mask"], b["labels"], chunk_size=4)
    assert torch.allclose(lp, b["old_logprobs"] * m, atol=1e-4)


def test_chunked_scoring_with_temperature_equals_full(lm, prompts):
    """logprob_chunk_size's path: the LM head over chunks of positions, at the sampling temperature."""
    out = generate(lm, 256, prompts, max_new_tokens=8, seed=0, temperature=0.7)
    b = out.to_batch()
    full, m = sequence_logprobs(lm, b["input_ids"], b["attention_mask"], b["labels"], temperature=0.7)
    chunked, _ = sequence_logprobs(lm, b["input_ids"], b["attention_mask"], b["labels"], chunk_size=3,
                                   temperature=0.7)
    assert torch.allclose(full * m, chunked, atol=1e-5)
    assert torch.allclose(chunked, b["old_logprobs"] * m, atol=1e-4)  # the sampler's log-probs at T = 0.7


class _EOSFromPosition(torch.nn.Module):
    """Wraps an LM so that EOS wins once a row's query position reaches `at` (a function of the row's
    own positions, not of its index in the batch, so it survives rows leaving the decode batch)."""

    def __init__(self, lm, at):
        super().__init__()
        self.lm, self.at, self.config = lm, at, lm.config
        self.batch_sizes = []  # rows of each forward

    def forward(self, input_ids=None, position_ids=None, cache=None, **kw):
        self.batch_sizes.append(input_ids.shape[0])
        out = self.lm(input_ids=input_ids, position_ids=position_ids, cache=cache, **kw)
        out.logits[..., EOS] += 1e4 * (position_ids[:, -out.logits.shape[1]:] >= self.at).float()
        return out


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_dropping_finished_rows_changes_no_output(lm, sampling):
    """Uneven lengths: prompts of 1..6 tokens with EOS from position 9 finish after 9..4 new tokens (and
    rows that sample EOS by themselves earlier). Dropping finished rows from the decode batch gives the
    same tokens, masks, finish reasons and log-probs as keeping every row to the end (the former path)."""
    wrapped = _EOSFromPosition(lm, at=9)
    prompts = [[257] + list(range(60, 60 + k)) for k in range(6)]
    kw = dict(max_new_tokens=14, seed=11, eos_token_id=EOS, num_samples=2, **sampling)
    kept = generate(wrapped, 256, prompts, drop_finished=False, **kw)
    assert wrapped.batch_sizes[0] == 6 and set(wrapped.batch_sizes[1:]) == {12}  # 6 prompts prefilled once
    wrapped.batch_sizes.clear()
    dropped = generate(wrapped, 256, prompts, drop_finished=True, **kw)
    assert wrapped.batch_sizes[0] == 6 and wrapped.batch_sizes[-1] < 12  # the shared prefill; rows did leave the batch
    assert torch.equal(dropped.mask, kept.mask) and torch.equal(dropped.tokens, kept.tokens)
    assert dropped.finish_reasons == kept.finish_reasons
    assert torch.allclose(dropped.logprobs, kept.logprobs, atol=1e-6, rtol=0)
    # the lengths really are uneven: new token j of a prompt of k + 1 tokens is predicted at position
    # k + j, so EOS comes at the latest as token 10 - k (fewer if the row samples EOS itself)
    lengths = dropped.lengths.view(6, 2)
    assert (lengths <= torch.tensor([10 - k for k in range(6)])[:, None]).all()
    assert int(lengths.max()) > int(lengths.min())


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.0)])
def test_shared_prefill_gives_the_same_rollout(lm, sampling):
    """num_samples > 1: one prefill per distinct prompt, its cache repeated, gives the tokens, masks and
    log-probs of num_samples separate prefills, and the model sees the prompts once in the prefill."""
    wrapped = _EOSFromPosition(lm, at=9)
    prompts = [[257] + list(range(60, 60 + k)) for k in range(1, 5)]
    kw = dict(max_new_tokens=12, seed=5, eos_token_id=EOS, num_samples=3, **sampling)
    separate = generate(wrapped, 256, prompts, share_prefill=False, **kw)
    assert wrapped.batch_sizes[0] == 12
    wrapped.batch_sizes.clear()
    shared = generate(wrapped, 256, prompts, share_prefill=True, **kw)
    assert wrapped.batch_sizes[0] == 4  # the prefill ran on the 4 prompts, not the 12 rows
    assert torch.equal(shared.tokens, separate.tokens) and torch.equal(shared.mask, separate.mask)
    assert shared.finish_reasons == separate.finish_reasons
    assert torch.allclose(shared.logprobs, separate.logprobs, atol=1e-5, rtol=0)


def test_lora_model_samples_with_its_adapters_merged(tiny_llama, prompts, monkeypatch):
    """A PEFT LoRA model decodes with the adapters merged into its base weights (one matmul per layer),
    gives the unmerged model's tokens and log-probs, and gets its base weights back (to float rounding)."""
    from peft import LoraConfig, get_peft_model

    import rl.engine.generation as generation
    from rl.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = get_peft_model(load_causal_lm(tiny_llama, dtype="float32"),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    seen = []
    layer.register_forward_hook(lambda m, i, o: seen.append(m.merged))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = generate(model, EOS, prompts, max_new_tokens=6, seed=3, num_samples=2)
    # the KV cache goes in by the base model's keyword (`cache`), not the deprecated past_key_values
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert seen and all(seen)  # every decode step ran merged
    assert not layer.merged
    for n, p in model.named_parameters():
        if n in base:
            torch.testing.assert_close(p, base[n], atol=1e-6, rtol=0)
    seen.clear()
    monkeypatch.setattr(generation, "lora_merged", lambda m: generation.contextmanager(lambda: (yield))())
    plain = generate(model, EOS, prompts, max_new_tokens=6, seed=3, num_samples=2)
    assert seen and not any(seen)
    assert torch.equal(merged.tokens, plain.tokens)
    torch.testing.assert_close(merged.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    # an adapter merged by its owner stays merged (and is not merged twice)
    model.base_model.merge_adapter()
    generate(model, EOS, prompts, max_new_tokens=2, seed=3)
    assert layer.merged


def test_cpu_sampling_uses_prepacked_weights_and_the_same_numbers(lm, prompts, monkeypatch):
    """On CPU a rollout of >= PREPACK_MIN_NEW_TOKENS computes its linear layers with oneDNN-prepacked
    weights, gets the plain path's tokens and log-probs (fp32, summation order only), and leaves the
    modules as they were."""
    import rl.engine.generation as generation

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(generation.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a),
                        raising=False)
    n = generation.PREPACK_MIN_NEW_TOKENS
    fast = generate(lm, EOS, prompts, max_new_tokens=n, seed=5, num_samples=2, stop_token_ids=[])
    assert calls  # the prepacked path ran
    assert not any("forward" in m.__dict__ for m in lm.modules())  # and was undone
    calls.clear()
    monkeypatch.setattr(generation, "PREPACK_MIN_NEW_TOKENS", 10 ** 9)
    plain = generate(lm, EOS, prompts, max_new_tokens=n, seed=5, num_samples=2, stop_token_ids=[])
    assert not calls
    assert torch.equal(fast.tokens, plain.tokens) and torch.equal(fast.mask, plain.mask)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=0)
