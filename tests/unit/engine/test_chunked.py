"""Chunked LM-head log-probs (rl.engine.chunked): equal to the full logits path, values and gradients, on
every tiny family (full and LoRA, Gemma 2's soft-capping), and without a (B, T, V) tensor."""

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rl.engine import chunked
from rl.engine.chunked import HeadLogits, auto_chunk_size, capture_head
from rl.engine.losses import token_logprobs
from rl.models.tiny import build_config
from rl.trainers import ppo_math

V = 300


class LiveTensors(TorchDispatchMode):
    """Every tensor storage created inside the block: the peak of their summed bytes while alive
    and the largest single tensor (elements); autograd's backward on the CPU runs in this thread."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = self.largest = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                st = t.untyped_storage()
                if id(st) not in self._alive:
                    self._alive.add(id(st))
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, id(st), st.nbytes())
        return out

    def _free(self, key, n):
        self._alive.discard(key)
        self.now -= n


def _model(family: str, lora: bool = False, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if family == "gemma2":  # final_logit_softcapping: the model applies / cap, tanh, * cap after the head
        cfg = AutoConfig.for_model("gemma2", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   final_logit_softcapping=2.0, pad_token_id=0)
    else:
        cfg = build_config(family, V, hidden=32, layers=1, heads=2)
    for k, v in config.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["c_attn", "lm_head"] if family == "gpt2" else ["q_proj", "v_proj", "lm_head"]
        # init_lora_weights=False: B != 0, so the adapters' A and B both get gradients
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return model.eval()  # no dropout (GPT-2's config has 0.1): the two paths must see the same function


def _batch(B=3, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :4] = -100  # a prompt
    w = torch.randn(B, T - 1, generator=g)
    return ids, mask, labels, w


def _logp_and_grads(model, chunk: int | None, temperature: float = 1.0):
    ids, mask, labels, w = _batch()
    model.zero_grad(set_to_none=True)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with capture_head(model, chunk) if chunk else torch.enable_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    assert isinstance(logits, HeadLogits) == bool(chunk)
    logp, m = token_logprobs(logits / temperature, labels)
    (logp * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach(), m, grads


@pytest.mark.parametrize("family,lora", [("llama", False), ("qwen2", False), ("gemma", False), ("gpt2", False),
                                         ("gemma2", False), ("llama", True), ("gpt2", True), ("gemma2", True)])
def test_chunked_logprobs_and_gradients_equal_the_full_path(family, lora):
    model = _model(family, lora)
    full_lp, full_m, full_g = _logp_and_grads(model, None, temperature=0.7)
    lp, m, g = _logp_and_grads(model, 4, temperature=0.7)  # 10 positions: chunks of 4, 4, 2
    assert torch.equal(m, full_m)
    assert full_lp.abs().sum() > 0 and (full_lp <= 0).all()
    torch.testing.assert_close(lp, full_lp, atol=1e-5, rtol=1e-5)
    assert g.keys() == full_g.keys() and len(g) > 0
    for name in g:
        assert full_g[name].abs().sum() > 0 or "lora_A" not in name, name  # adapters really train
        torch.testing.assert_close(g[name], full_g[name], atol=1e-5, rtol=1e-5, msg=name)
    # the head's own gradient flows (LoRA on lm_head, or the tied embedding)
    assert any(("lm_head" in n or "embed" in n or "wte" in n) and v.abs().sum() > 0 for n, v in g.items())


def test_head_logits_replays_the_model_steps_and_falls_back_to_the_full_tensor():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    cap, t = 3.0, 0.5
    lazy = torch.tanh(HeadLogits(hidden, head, chunk_size=3) / cap) * cap / t
    full = torch.tanh(head(hidden) / cap) * cap / t
    assert isinstance(lazy, HeadLogits) and lazy.shape == full.shape
    torch.testing.assert_close(lazy.materialize(), full)
    # anything else is the full tensor: a torch function, a tensor method
    torch.testing.assert_close(torch.log_softmax(lazy, -1), torch.log_softmax(full, -1))
    torch.testing.assert_close(lazy.softmax(-1), full.softmax(-1))
    torch.testing.assert_close(1 - lazy, 1 - full)
    torch.testing.assert_close(-lazy + 2, -full + 2)
    # the argmax over the vocabulary (SFT's mean_token_accuracy) chunk by chunk, also of a slice
    assert torch.equal(lazy.argmax(-1), full.argmax(-1)) and torch.equal(lazy[:, :-1].argmax(-1), full[:, :-1].argmax(-1))
    # log-probs and entropy, by hand from the full logits: log p = z_y - logsumexp z, H = -sum p log p
    y = torch.randint(0, 50, (2, 7))
    logp, ent = lazy.logprobs(y, with_entropy=True)
    ref = torch.log_softmax(full, -1)
    torch.testing.assert_close(logp, ref.gather(-1, y[..., None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    (gh,) = torch.autograd.grad((logp.sum() + ent.sum()), hidden)
    (gf,) = torch.autograd.grad((ref.gather(-1, y[..., None]).sum() - (ref.exp() * ref).sum()), hidden)
    torch.testing.assert_close(gh, gf)


def test_auto_chunk_size_threshold():
    assert auto_chunk_size(2, 10, 300) is None  # small: the full path
    assert auto_chunk_size(2, 10, 300, 4) == 4  # set: always
    assert auto_chunk_size(8, 2048, 152_064, 0) is None  # 0: never
    n = chunked.AUTO_MIN_ELEMENTS
    assert auto_chunk_size(1, n // 1000, 1000) is None
    c = auto_chunk_size(8, 2048, 152_064)
    assert c == chunked.CHUNK_ELEMENTS // (8 * 152_064) and 8 * c * 152_064 <= chunked.CHUNK_ELEMENTS


def _train_step_memory(T: int, chunk: int | None, V: int = 2048):
    """Peak live bytes and largest tensor of forward + backward of token log-probs at length T."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("llama", V, hidden=16, layers=1, heads=2))
    ids = torch.randint(3, V, (2, T))
    with LiveTensors() as probe:
        with capture_head(model, chunk) if chunk else torch.enable_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        logp, _ = token_logprobs(logits, ids)
        logp.sum().backward()
        del logits, logp
    return probe


def test_no_tensor_grows_with_length_times_vocabulary():
    B, V, chunk = 2, 2048, 8
    block = B * 64 * V * 4  # bytes of (B, 64, V) fp32 logits: what 64 more positions cost the full path
    full_short, full_long = _train_step_memory(64, None), _train_step_memory(128, None)
    assert full_long.largest >= B * 128 * V  # the (B, T, V) logits
    assert full_long.peak - full_short.peak > 2 * block  # measured: ~4.2 blocks (logits, fp32, softmax grad)
    short, long = _train_step_memory(64, chunk), _train_step_memory(128, chunk)
    # largest tensor: the (V, H) embedding or one (B, chunk, V) block, whatever T is
    assert long.largest == short.largest <= max(B * chunk * V, V * 16)
    # the peak grows with T only through activations ((B, T, H), attention): measured ~0.24 block
    assert long.peak - short.peak < block / 2
    assert long.peak < full_long.peak / 3


def test_pipeline_training_forward_chunks_and_equals_the_full_path():
    """Through the engine, with the trainers' loss callables (SFT, DPO, GRPO with a temperature) and a
    plain token loss: the same losses and accumulated gradients chunked and full."""
    from functools import partial

    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.trainers.dpo import dpo_batch_loss
    from rl.trainers.grpo import grpo_loss_fn
    from rl.trainers.sft import sum_normalised_nll

    base = _model("llama")
    ids, mask, labels, _ = _batch(B=4)
    seen = []

    def spy(fn):
        def wrapped(logits, *a, **k):
            seen.append(type(logits))
            return fn(logits, *a, **k)
        return wrapped

    loss_fns = [spy(partial(sum_normalised_nll, scale=0.1)),
                spy(partial(dpo_batch_loss, loss_type="sigmoid", beta=0.1,
                            ref_chosen_logps=torch.tensor([-30.0, -20.0]),
                            ref_rejected_logps=torch.tensor([-25.0, -31.0]))),
                spy(partial(grpo_loss_fn, advantages=torch.tensor([1.0, -1.0, 0.5, 0.25]), temperature=0.7)),
                spy(lambda logits, labels, attention_mask: (-token_logprobs(logits, labels)[0].sum(), {}))]
    results = {}
    for chunk in (0, 3):
        pipe = ForwardBackwardPipeline(copy.deepcopy(base), device="cpu", logprob_chunk_size=chunk,
                                       gradient_accumulation_steps=len(loss_fns))
        seen.clear()
        values = [pipe.forward_backward(ids, mask, labels, loss_fn=fn).result().loss for fn in loss_fns]
        assert seen == [HeadLogits if chunk else torch.Tensor] * len(loss_fns)
        results[chunk] = (values, {n: p.grad.clone() for n, p in pipe.unwrapped_model.named_parameters()})
    assert results[0][0] == pytest.approx(results[3][0], abs=1e-5) and all(v != 0 for v in results[0][0])
    for n, g in results[0][1].items():
        torch.testing.assert_close(results[3][1][n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_ppo_policy_loss_through_the_engine_chunked_equals_full(monkeypatch):
    """PPO's custom loss (log-probs and entropy of the response, value head on the same forward):
    the same loss, metrics and gradients with the LM head chunked."""
    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.models.value import PPOModel
    from rl.trainers.ppo_math import policy_loss, response_logprobs

    seen = []
    real = response_logprobs
    monkeypatch.setattr(ppo_math, "response_logprobs",
                        lambda logits, *a, **k: seen.append(type(logits)) or real(logits, *a, **k))
    base = PPOModel(_model("llama"))
    torch.nn.init.normal_(base.value_head.out.weight, std=0.1)  # a value head that has gradients
    ids, mask, _, _ = _batch()
    P, N = 5, ids.shape[1] - 5
    g = torch.Generator().manual_seed(2)
    kw = dict(P=P, tokens=ids[:, P:], mask=torch.ones(3, N), old_logprobs=-torch.rand(3, N, generator=g) * 5,
              advantages=torch.randn(3, N, generator=g), old_values=torch.randn(3, N, generator=g),
              returns=torch.randn(3, N, generator=g), entropy_coef=0.1, temperature=0.7)
    results = {}
    for chunk in (0, 2):
        pipe = ForwardBackwardPipeline(copy.deepcopy(base), device="cpu", logprob_chunk_size=chunk)
        r = pipe.forward_backward_custom(policy_loss, ids, mask, **kw).result()
        results[chunk] = (r, {n: p.grad.clone() for n, p in pipe.unwrapped_model.named_parameters()})
    assert seen == [torch.Tensor, HeadLogits]
    (full, gf), (chunked, gc) = results[0], results[2]
    assert full.metrics.keys() == chunked.metrics.keys() and "policy/entropy" in full.metrics
    for k, v in full.metrics.items():
        assert chunked.metrics[k] == pytest.approx(v, abs=1e-5), k
    for n, v in gf.items():
        torch.testing.assert_close(gc[n], v, atol=1e-5, rtol=1e-5, msg=n)


def test_nothing_counted_still_gives_the_head_a_zero_gradient():
    """Only counted positions go through the head; with none (a padding micro-batch) one still does,
    so that every parameter gets a (zero) gradient, as DDP expects."""
    model = _model("llama")
    ids = torch.randint(3, V, (2, 6))
    labels = torch.full_like(ids, -100)
    with capture_head(model, 2):
        logits = model(input_ids=ids, use_cache=False).logits
    logp, m = token_logprobs(logits, labels)
    assert m.sum() == 0 and torch.equal(logp, torch.zeros(2, 5))
    logp.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in model.parameters())
