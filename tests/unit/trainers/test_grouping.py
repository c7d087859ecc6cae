"""Length-grouped GRPO micro-batches (rl.trainers.grpo_batch `length_grouped_slices`, `take_micro_batch`; rl.trainers.grpo
`_logprobs`): rows sorted by length and cut into equal groups, each trimmed to its own widest row, give the same log-probs, loss and
gradients as the former contiguous, full-width micro-batches; per-row results come back in row order. So do
shared prompts (`share_prompt_forward`, the default: each group's prompt computed once, rl.engine.segments)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.config.fields import build
from rl.engine.generation import Rollout
from rl.engine.packing import left_pad, position_ids_from_mask
from rl.engine.pipeline import ForwardBackwardPipeline
from rl.engine.scoring import sequence_logprobs
from rl.trainers import grpo
from rl.trainers.grpo import GRPOTrainer, grpo_loss_fn
from rl.trainers.grpo_batch import length_grouped_slices, take_micro_batch
from rl.trainers.grpo_config import GRPOConfig


@pytest.fixture(scope="module")
def lm(tiny_llama):
    from rl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_llama, dtype="float32")
    model.eval()
    return model


def _mask(lengths, width):
    return torch.tensor([[1] * n + [0] * (width - n) for n in lengths])


def _uneven_batch(seed=0, groups=False):
    """A rollout batch of 6 rows, prompts of 1-5 tokens (left-padded), completions of 1-9 (right-padded),
    random tokens; the sampler's old log-probs are random negatives. `groups`: rows 2k and 2k+1 share
    their prompt (a GRPO group of 2)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, comp_lens = [3, 1, 5, 2, 4, 1], [9, 2, 1, 7, 3, 5]
    prompts = [[257] + torch.randint(3, 250, (n - 1,), generator=g).tolist() for n in prompt_lens]
    if groups:
        prompts = [prompts[i - i % 2] for i in range(6)]
    ids, pmask = left_pad(prompts, 256)
    N = max(comp_lens)
    mask = _mask(comp_lens, N)
    tokens = torch.randint(3, 250, (6, N), generator=g).masked_fill(mask == 0, 256)
    logprobs = -torch.rand(6, N, generator=g) * mask
    return Rollout(tokens=tokens, logprobs=logprobs, mask=mask, prompts=prompts, prompt_ids=ids,
                   prompt_mask=pmask, pad_token_id=256).to_batch()


def test_length_grouped_slices_group_rows_by_length():
    # attended lengths 3 7 5 1 7 2 -> longest first, ties in order: rows 1 4 | 2 0 | 5 3
    mask = _mask([3, 7, 5, 1, 7, 2], 8)
    assert [m.tolist() for m in length_grouped_slices(mask, 3)] == [[1, 4], [0, 2], [3, 5]]
    # equal lengths: the contiguous slices of before
    ones = torch.ones(6, 4, dtype=torch.long)
    assert [m.tolist() for m in length_grouped_slices(ones, 3)] == [[0, 1], [2, 3], [4, 5]]
    assert [m.tolist() for m in length_grouped_slices(mask, 1)] == [[0, 1, 2, 3, 4, 5]]


def test_take_trims_each_micro_batch_to_its_widest_row():
    b = _uneven_batch()
    P, T = 5, 5 + 9
    # rows 1 (prompt 1, completion 2) and 5 (prompt 1, completion 5): columns P-1 .. P+5
    mb, (a, e) = take_micro_batch(b, torch.tensor([1, 5]), with_span=True)
    assert (a, e) == (P - 1, P + 5) and mb["input_ids"].shape == (2, 6) and mb["old_logprobs"].shape == (2, 5)
    # rows 0 (prompt 3, completion 9) and 2 (prompt 5, completion 1): the full width
    assert take_micro_batch(b, torch.tensor([0, 2]), with_span=True)[1] == (0, T)
    for rows in ([1, 5], [3, 4], [0, 2, 3]):
        r = torch.tensor(rows)
        mb, (a, e) = take_micro_batch(b, r, with_span=True)
        # nothing attended is dropped, and everything kept is the batch's own
        assert int(mb["attention_mask"].sum()) == int(b["attention_mask"][r].sum())
        assert torch.equal(mb["input_ids"], b["input_ids"][r, a:e])
        positions = position_ids_from_mask(b["attention_mask"])[r, a:e]
        assert torch.equal(position_ids_from_mask(mb["attention_mask"]), positions)
        # (B, T-1) tensors stay aligned with labels[:, 1:]: the sampled log-prob sits under its label
        keep = mb["labels"][:, 1:] != -100
        full_keep = b["labels"][r, 1:] != -100
        assert torch.equal(mb["old_logprobs"][keep], b["old_logprobs"][r][full_keep])
    picked = take_micro_batch({"adv": torch.arange(6.0), **b}, torch.tensor([4, 1]))
    assert torch.equal(picked["adv"], torch.tensor([4.0, 1.0]))


def test_grouped_scoring_equals_one_full_batch_forward(lm):
    """`GRPOTrainer._logprobs` over length-grouped, trimmed micro-batches = one forward of the whole
    padded batch, in the batch's row order and width (to 1e-6), at a sampling temperature."""
    b = _uneven_batch()
    mask = b["attention_mask"]
    full, m = sequence_logprobs(lm, b["input_ids"], mask, b["labels"], position_ids=position_ids_from_mask(mask),
                                temperature=0.7)
    me = SimpleNamespace(cfg=SimpleNamespace(logprob_chunk_size=None, temperature=0.7), _share=False)
    for parts in (1, 2, 3):
        micro = length_grouped_slices(mask, parts)
        got = GRPOTrainer._logprobs(me, lm, b, micro, 5)
        assert got.shape == full.shape
        torch.testing.assert_close(got * m, full * m, atol=1e-6, rtol=0)
        assert (got[m == 0] == 0).all()


def test_shared_prompt_scoring_equals_one_full_batch_forward(lm):
    """`GRPOTrainer._logprobs` with shared prompts (each group's prompt computed once, packed) = one
    forward of the whole padded batch, in the batch's row order and width, for 1-3 contiguous micro-batches."""
    b = _uneven_batch(groups=True)
    mask = b["attention_mask"]
    full, m = sequence_logprobs(lm, b["input_ids"], mask, b["labels"], position_ids=position_ids_from_mask(mask),
                                temperature=0.7)
    me = SimpleNamespace(cfg=SimpleNamespace(logprob_chunk_size=None, temperature=0.7), _share=True,
                         _shared=lambda mb, width: GRPOTrainer._shared(None, mb, width))
    for parts in (1, 2, 3):
        got = GRPOTrainer._logprobs(me, lm, b, list(torch.arange(6).chunk(parts)), 5)
        assert got.shape == full.shape
        torch.testing.assert_close(got * m, full * m, atol=1e-5, rtol=0)
        assert (got[m == 0] == 0).all()


def _accumulate(model, batch, per_row, micro, trim, **loss_kw):
    """What train_step does with its micro-batches: loss / parts, backward; returns (loss, grads)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s in micro:
        mb = take_micro_batch({**batch, **per_row}, s) if trim else {k: v[s] for k, v in {**batch, **per_row}.items()}
        out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                    position_ids=position_ids_from_mask(mb["attention_mask"]))
        loss, _ = grpo_loss_fn(out.logits, mb["labels"], mb["attention_mask"], advantages=mb["adv"],
                               old_logprobs=mb["old"], ref_logprobs=mb["ref"], **loss_kw)
        (loss / len(micro)).backward()
        total += float(loss.detach()) / len(micro)
    return total, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_grouped_loss_and_gradients_equal_contiguous_full_width(lm, aggregation):
    """Off-policy with a KL term: loss and gradients of 3 length-grouped, trimmed micro-batches equal
    those of 3 contiguous full-width ones (the former path) to 1e-6 / 1e-5, for every aggregation."""
    b = _uneven_batch(1)
    g = torch.Generator().manual_seed(2)
    lab = (b["labels"][:, 1:] != -100).float()
    per_row = {"adv": torch.randn(6, generator=g), "old": b["old_logprobs"] - 0.1 * lab,
               "ref": b["old_logprobs"] + 0.2 * torch.rand(6, b["old_logprobs"].shape[1], generator=g) * lab}
    kw = dict(temperature=0.7, beta=0.1, epsilon_low=0.2, epsilon_high=0.28, loss_aggregation=aggregation,
              max_completion_length=9, num_items=float(lab.sum()) / 3)
    lm.train()
    try:
        contiguous = [torch.arange(i * 2, i * 2 + 2) for i in range(3)]
        ref_loss, ref_grads = _accumulate(lm, b, per_row, contiguous, trim=False, **kw)
        grouped = length_grouped_slices(b["attention_mask"], 3)
        assert [m.tolist() for m in grouped] != [m.tolist() for m in contiguous]  # a real regrouping
        loss, grads = _accumulate(lm, b, per_row, grouped, trim=True, **kw)
    finally:
        lm.eval()
        lm.zero_grad(set_to_none=True)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    for a, e in zip(grads, ref_grads):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_train_step_with_grouping_equals_the_former_micro_batches(tiny_llama, tmp_path, monkeypatch):
    """The trainer's wiring (scoring forwards, per-row advantages / old / ref log-probs, training
    micro-batches): prompts of 1-8 characters make rows of different lengths; one step with 2 grouped,
    trimmed micro-batches (num_iterations 2, beta > 0: both scoring forwards run; max_steps 2, the two
    updates of that one generation batch) gives the same loss,
    KL and accumulated gradients (at the first optimizer step, before Adam, whose normalisation would
    amplify float noise in near-zero gradients) as contiguous full-width micro-batches (the former path)."""
    grads = []
    real_step = ForwardBackwardPipeline.optim_step

    def recording_step(self, *a, **k):
        grads.append([p.grad.clone() for p in self.model.parameters()])
        return real_step(self, *a, **k)

    monkeypatch.setattr(ForwardBackwardPipeline, "optim_step", recording_step)

    def run(out, share=False):
        cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(out), learning_rate=1e-2, per_device_train_batch_size=4,
                                     gradient_accumulation_steps=2, num_generations=2, max_completion_length=4,
                                     max_length=24, max_steps=2, num_iterations=2, beta=0.1, report_to=["none"],
                                     seed=0, share_prompt_forward=share))
        rows = [{"prompt": "x" * k} for k in range(1, 9)]
        t = GRPOTrainer(cfg, reward_funcs=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
                        train_prompts=rows)
        hist = t.train()
        return hist[0], grads.pop(0)

    widths, real_take = [], grpo.take_micro_batch

    def recording_take(batch, rows, with_span=False):
        mb = real_take(batch, rows, with_span)
        widths.append(((mb[0] if with_span else mb)["input_ids"].shape[1], batch["input_ids"].shape[1]))
        return mb

    monkeypatch.setattr(grpo, "take_micro_batch", recording_take)
    grouped_row, grouped_g = run(tmp_path / "grouped")
    grads.clear()
    assert any(w < full for w, full in widths)  # some micro-batch really was narrower than the batch

    def contiguous(mask, parts):
        n = mask.shape[0] // parts
        return [torch.arange(i * n, (i + 1) * n) for i in range(parts)]

    monkeypatch.setattr(grpo, "length_grouped_slices", contiguous)
    monkeypatch.setattr(grpo, "take_micro_batch", lambda batch, rows, with_span=False: (
        ({k: v[rows] for k, v in batch.items()}, (0, batch["attention_mask"].shape[1])) if with_span
        else {k: v[rows] for k, v in batch.items()}))
    former_row, former_g = run(tmp_path / "former")
    for k in ("loss", "kl"):
        assert grouped_row[k] == pytest.approx(former_row[k], abs=1e-5), k
    assert len(grouped_g) == len(former_g) > 0
    for a, e in zip(grouped_g, former_g):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    monkeypatch.undo()
    monkeypatch.setattr(ForwardBackwardPipeline, "optim_step", recording_step)
    grads.clear()
    # the default: each group's prompt computed once, completions packed (scoring and training forwards)
    packed, real_pack = [], grpo.pack_shared_prompts
    monkeypatch.setattr(grpo, "pack_shared_prompts", lambda *a: packed.append(a[0].shape) or real_pack(*a))
    shared_row, shared_g = run(tmp_path / "shared", share=True)
    assert len(packed) == 8  # 2 micro-batches x (reference, old log-probs, 2 training iterations)
    for k in ("loss", "kl"):
        assert shared_row[k] == pytest.approx(former_row[k], abs=1e-5), k
    for a, e in zip(shared_g, former_g):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
