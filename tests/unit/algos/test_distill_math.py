"""GKD's generalised Jensen-Shannon divergence: hand-computed on a 2-token vocabulary, and equal to
TRL 1.16's GKDTrainer.generalized_jsd_loss on identical logits."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algos.distill import generalized_jsd, jsd_loss


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_jsd_hand_computed():
    # student logits (0, 0) -> S = (1/2, 1/2); teacher logits (log 3, 0) -> T = (3/4, 1/4)
    S, T = [0.5, 0.5], [0.75, 0.25]
    s, t = torch.tensor([0.0, 0.0]), torch.tensor([math.log(3.0), 0.0])
    assert generalized_jsd(s, t, beta=0.0).item() == pytest.approx(_kl(T, S), abs=1e-6)  # forward KL
    assert generalized_jsd(s, t, beta=1.0).item() == pytest.approx(_kl(S, T), abs=1e-6)  # reverse KL
    b = 0.25
    M = [(1 - b) * x + b * y for x, y in zip(S, T)]
    assert generalized_jsd(s, t, beta=b).item() == pytest.approx(b * _kl(T, M) + (1 - b) * _kl(S, M), abs=1e-6)
    # temperature 2: logits halved -> T = (sqrt 3, 1) / (sqrt 3 + 1)
    T2 = [math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1)]
    assert generalized_jsd(s, t, beta=0.0, temperature=2.0).item() == pytest.approx(_kl(T2, S), abs=1e-6)
    assert generalized_jsd(t, t, beta=0.5).item() == pytest.approx(0.0, abs=1e-7)
    # the loss: mean over counted positions only
    logits_s, logits_t = torch.stack([s, t, s]), torch.stack([t, t, s])
    mask = torch.tensor([True, True, False])
    assert jsd_loss(logits_s, logits_t, mask, beta=0.0).item() == pytest.approx(_kl(T, S) / 2, abs=1e-6)
    assert jsd_loss(logits_s, logits_t, torch.zeros(3, dtype=torch.bool)).item() == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jsd_matches_trl(beta, temperature, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's own switch: we import its experimental GKD on purpose
    from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(0)
    student, teacher = torch.randn(3, 7, 50) * 3, torch.randn(3, 7, 50) * 3
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = -100
    labels[2, 5:] = -100
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    ours = jsd_loss(student, teacher, labels != -100, beta=beta, temperature=temperature)
    diff = abs(ours.item() - theirs.item())
    print(f"\njsd beta={beta} T={temperature}: ours {ours.item():.6f} TRL {theirs.item():.6f} |diff| {diff:.2e}")
    assert diff < 1e-5
    # the gradients agree too
    s1, s2 = student.clone().requires_grad_(), student.clone().requires_grad_()
    GKDTrainer.generalized_jsd_loss(s1, teacher, labels=labels, beta=beta, temperature=temperature).backward()
    jsd_loss(s2, teacher, labels != -100, beta=beta, temperature=temperature).backward()
    assert (s1.grad - s2.grad).abs().max().item() < 1e-6
