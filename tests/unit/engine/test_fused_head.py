"""rl.engine.fused_head: the one-pass LM head + NLL against the plain F.cross_entropy(hidden @ W.T, targets)."""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from rl.engine.chunked import HeadLogits
from rl.engine.fused_head import head_nll, linear_nll


def _plain(hidden, weight, targets, bias=None):
    z = hidden @ weight.t() if bias is None else hidden @ weight.t() + bias
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


def _grads(loss, *ts):
    return torch.autograd.grad(loss, ts)


def test_loss_and_gradients_match_cross_entropy_with_ignored_positions():
    torch.manual_seed(0)
    N, H, V = 37, 16, 101
    hidden = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    targets[[0, 5, 6, 30]] = -100
    ref = _plain(hidden, weight, targets)
    ref_h, ref_w = _grads(ref, hidden, weight)
    for rows in (1, 7, 64):  # chunks smaller than, not dividing, and larger than N
        nll, correct = linear_nll(hidden, weight, targets, rows=rows)
        torch.testing.assert_close(nll, ref)
        g_h, g_w = _grads(nll * 3.0, hidden, weight)  # an upstream scale reaches both gradients
        torch.testing.assert_close(g_h, 3.0 * ref_h, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(g_w, 3.0 * ref_w, rtol=1e-6, atol=1e-8)
        z = hidden @ weight.t()
        keep = targets != -100
        assert int(correct) == int((z.argmax(-1)[keep] == targets[keep]).sum())


def test_hand_checked_two_token_vocabulary():
    # V = 2, W = I: logits are the hidden state itself; nll = log(1 + e^(z_other - z_target))
    hidden = torch.tensor([[0.0, 0.0], [1.0, 3.0]], requires_grad=True)
    weight = torch.eye(2, requires_grad=True)
    nll, correct = linear_nll(hidden, weight, torch.tensor([0, 1]))
    expected = torch.log(torch.tensor(2.0)) + torch.log1p(torch.exp(torch.tensor(-2.0)))
    torch.testing.assert_close(nll, expected)
    assert int(correct) == 2  # row 0 ties (the first maximum, 0, is its target), row 1 picks 1
    nll.backward()
    p1 = torch.sigmoid(torch.tensor(-2.0))  # softmax of row 1 at the wrong token
    torch.testing.assert_close(hidden.grad, torch.tensor([[-0.5, 0.5], [p1, -p1]]))


def test_bias_and_frozen_weight():
    torch.manual_seed(1)
    hidden = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64)  # a frozen head: only the hidden states get a gradient
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 9))
    targets[1, :4] = -100
    ref = _plain(hidden, weight, targets, bias)
    ref_h, ref_b = _grads(ref, hidden, bias)
    nll, _ = linear_nll(hidden, weight, targets, bias=bias, rows=5)
    g_h, g_b = _grads(nll, hidden, bias)
    torch.testing.assert_close(nll, ref)
    torch.testing.assert_close(g_h, ref_h)
    torch.testing.assert_close(g_b, ref_b)


def test_tied_weight_accumulates_with_the_embedding():
    torch.manual_seed(2)
    emb = torch.nn.Embedding(30, 8).double()
    ids = torch.randint(0, 30, (1, 12))
    targets = torch.randint(0, 30, (1, 12))

    def run(fused):
        emb.zero_grad()
        h = emb(ids) * 1.5
        loss = linear_nll(h, emb.weight, targets, rows=4)[0] if fused else _plain(h, emb.weight, targets)
        loss.backward()
        return emb.weight.grad.clone()

    torch.testing.assert_close(run(True), run(False))


def test_bf16_autocast_close_to_the_autocast_head():
    torch.manual_seed(3)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")
        nll, _ = linear_nll(hidden, weight, targets, rows=16)
    ref_h, ref_w = _grads(ref, hidden, weight)
    g_h, g_w = _grads(nll, hidden, weight)
    assert g_h.dtype == torch.float32 and g_w.dtype == torch.float32
    torch.testing.assert_close(nll, ref, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(g_h, ref_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g_w, ref_w, rtol=2e-2, atol=2e-2)


def test_head_nll_on_captured_logits_shifts_and_ignores():
    torch.manual_seed(4)
    head = torch.nn.Linear(8, 40, bias=False).double()
    hidden = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (2, 6))
    labels[0, :3] = -100
    nll, correct = head_nll(HeadLogits(hidden, head, 4).float(), labels, rows=3)
    ref = _plain(hidden[:, :-1], head.weight, labels[:, 1:])
    torch.testing.assert_close(nll, ref)
    g = _grads(nll, hidden, head.weight)
    r = _grads(ref, hidden, head.weight)
    torch.testing.assert_close(g[0], r[0])
    torch.testing.assert_close(g[1], r[1])
    # nothing counted: a zero loss that still reaches the head with a zero gradient
    nll0, c0 = head_nll(HeadLogits(hidden, head, 4), torch.full((2, 6), -100))
    assert float(nll0.detach()) == 0.0 and int(c0) == 0
    assert torch.count_nonzero(_grads(nll0, head.weight)[0]) == 0


def test_head_nll_declines_heads_it_cannot_fuse():
    head = torch.nn.Linear(8, 40)
    hidden = torch.randn(1, 3, 8)
    assert head_nll(HeadLogits(hidden, head, 4, ops=(torch.tanh,)), torch.zeros(1, 3, dtype=torch.long)) is None
    wrapped = torch.nn.Sequential(head)
    assert head_nll(HeadLogits(hidden, wrapped, 4), torch.zeros(1, 3, dtype=torch.long)) is None


@pytest.mark.parametrize("family,tied,lora", [("llama", True, False), ("llama", False, False), ("qwen2", True, False),
                                              ("llama", True, True), ("gemma2", True, False)])
@pytest.mark.parametrize("packed", [False, True])
def test_sft_loss_through_the_engine_equals_the_full_logits(family, tied, lora, packed):
    """SFT's loss with the head deferred (fused for a plain linear head; the chunked path for a LoRA or
    soft-capped head) against `logprob_chunk_size=0` (full logits): loss, nll, accuracy, every gradient."""
    from rl.engine.packing import pack_examples
    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.trainers.sft import sum_normalised_nll
    from tests.unit.engine.test_chunked import _batch, _model

    base = _model(family, lora, tie_word_embeddings=tied)
    ids, mask, labels, _ = _batch(B=3, T=11)
    kw = {}
    if packed:
        rows = [{"input_ids": ids[i][mask[i] == 1].tolist(), "labels": labels[i][mask[i] == 1].tolist()}
                for i in range(3)]
        b = pack_examples(rows)
        ids, mask, labels, kw = b["input_ids"], None, b["labels"], {"position_ids": b["position_ids"]}
    results = {}
    for chunk, defer in ((0, False), (None, True)):
        pipe = ForwardBackwardPipeline(copy.deepcopy(base), device="cpu", logprob_chunk_size=chunk)
        r = pipe.forward_backward(ids, mask, labels, loss_fn=partial(sum_normalised_nll, scale=0.1),
                                  defer_head=defer, **kw).result()
        grads = {n: p.grad.clone() for n, p in pipe.unwrapped_model.named_parameters() if p.requires_grad}
        results[defer] = (r, grads)
    (full, full_g), (fused, fused_g) = results[False], results[True]
    assert fused.loss == pytest.approx(full.loss, rel=1e-5) and full.loss != 0
    assert fused.metrics["nll"] == pytest.approx(full.metrics["nll"], rel=1e-5)
    assert fused.metrics["correct"] == full.metrics["correct"] and fused.num_tokens == full.num_tokens
    assert full_g.keys() == fused_g.keys()
    for n, g in full_g.items():
        torch.testing.assert_close(fused_g[n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_defer_head_takes_the_fused_path_and_respects_never_chunk(monkeypatch):
    from rl.engine import fused_head
    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.trainers import sft
    from tests.unit.engine.test_chunked import _batch, _model

    calls = []
    real = fused_head.linear_nll
    monkeypatch.setattr(fused_head, "linear_nll", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask, labels, _ = _batch()
    for chunk, expected in ((None, 1), (0, 0)):
        calls.clear()
        pipe = ForwardBackwardPipeline(_model("llama"), device="cpu", logprob_chunk_size=chunk)
        pipe.forward_backward(ids, mask, labels, loss_fn=partial(sft.sum_normalised_nll, scale=1.0),
                              defer_head=True).result()
        assert len(calls) == expected


def test_no_counted_position_gives_zero_gradients():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    nll, correct = linear_nll(hidden, weight, torch.full((4,), -100))
    nll.backward()
    assert float(nll.detach()) == 0.0 and int(correct) == 0
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0
