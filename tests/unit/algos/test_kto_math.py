"""KTO's math (rl.algos.kto) and its engine loss, hand-computed; the unpaired collation's mismatched rows."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algos.kto import kl_reference_point, kto_loss


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_kto_loss_hand_computed():
    logps, ref = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -4.0, -2.5])  # ratios 1, -1, 0.5
    desirable = torch.tensor([True, False, False])
    z0 = kl_reference_point(torch.tensor([-6.0, -7.0]), torch.tensor([-6.5, -7.1])).clamp(min=0)  # mean 0.3
    assert z0.item() == pytest.approx(0.3)
    losses, rewards = kto_loss(logps, ref, desirable, z0, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    want = [2.0 * (1 - _sig(0.5 * (1 - 0.3))), 0.5 * (1 - _sig(0.5 * (0.3 + 1))), 0.5 * (1 - _sig(0.5 * (0.3 - 0.5)))]
    assert losses.tolist() == pytest.approx(want, abs=1e-6)
    assert rewards.tolist() == pytest.approx([0.5, -0.5, 0.25])
    # a negative KL estimate is clamped to 0 by the trainer; z0 carries no gradient
    assert kl_reference_point(torch.tensor([-7.0]), torch.tensor([-6.0])).clamp(min=0).item() == 0.0
    lp = logps.clone().requires_grad_()
    kl = torch.tensor([-6.0], requires_grad=True)
    kto_loss(lp, ref, desirable, kl_reference_point(kl, torch.tensor([-6.5])), 0.5)[0].sum().backward()
    assert kl.grad is None and lp.grad is not None
    # d/dr of 1 - sigmoid(beta (r - z0)) = -beta s (1 - s), here z0 = -6 - (-6.5) = 0.5
    s = _sig(0.5 * (1 - 0.5))
    assert lp.grad[0].item() == pytest.approx(-0.5 * s * (1 - s), abs=1e-6)


def test_kto_batch_loss_weights_and_label_sums():
    from rl.trainers.kto import kto_batch_loss, label_means

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.tensor([[-100, -100, 4, 5, -100], [-100, 3, 2, 1, 7], [-100, -100, -100, 9, 10]])
    from rl.engine.scoring import sequence_logps

    logps, _ = sequence_logps(logits, labels)
    ref = logps.detach() - torch.tensor([0.2, -0.4, 0.1])
    d = torch.tensor([True, False, True])
    loss, m = kto_batch_loss(logits, labels, None, ref_logps=ref, desirable=d, z0=0.1, beta=0.1,
                             row_weight=torch.tensor([0.5, 0.5, 0.0]))  # the third row is padding
    per_row, rewards = kto_loss(logps, ref, d, 0.1, 0.1)
    assert loss.item() == pytest.approx(0.5 * (per_row[0] + per_row[1]).item(), abs=1e-6)
    assert (m["n_c"].item(), m["n_r"].item()) == (1.0, 1.0)
    means = label_means({k: float(v) for k, v in m.items()})
    assert means["rewards/chosen"] == pytest.approx(rewards[0].item(), abs=1e-6)
    assert means["rewards/margins"] == pytest.approx((rewards[0] - rewards[1]).item(), abs=1e-6)


def test_collate_unpaired_rotates_completions():
    from rl.data.kto import collate_unpaired

    ex = [{"prompt_ids": [1, 2], "completion_ids": [3], "label": True},
          {"prompt_ids": [4], "completion_ids": [5, 6], "label": False},
          {"prompt_ids": [7], "completion_ids": [8], "label": True}]
    b = collate_unpaired(ex, pad_token_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert b["labels"].tolist() == [[-100, -100, 3], [-100, 5, 6], [-100, 8, -100]]
    assert b["label"].tolist() == [True, False, True]
    # prompt i with completion i-1 (cyclically): (x1, y3), (x2, y1), (x3, y2)
    assert b["kl_input_ids"].tolist() == [[1, 2, 8], [4, 3, 0], [7, 5, 6]]
    assert b["kl_labels"].tolist() == [[-100, -100, 8], [-100, 3, -100], [-100, 5, 6]]
