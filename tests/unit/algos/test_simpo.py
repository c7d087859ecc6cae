"""SimPO (Meng et al. 2024) as a registered preference loss: hand-computed numbers, no model."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algos.preference import needs_reference, preference_loss, simpo_loss


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_simpo_hand_computed():
    # pair 0: mean logps -2/2 = -1 and -6/3 = -2: h = 2 * (1) - 0.5 = 1.5
    # pair 1: mean logps -8/4 = -2 and -1/1 = -1: h = 2 * (-1) - 0.5 = -2.5
    c, r = torch.tensor([-2.0, -8.0]), torch.tensor([-6.0, -1.0])
    cl, rl = torch.tensor([2, 4]), torch.tensor([3, 1])
    got = simpo_loss(c, r, cl, rl, beta=2.0, gamma=0.5)
    assert got.tolist() == pytest.approx([-_logsig(1.5), -_logsig(-2.5)], abs=1e-6)
    smooth = simpo_loss(c, r, cl, rl, beta=2.0, gamma=0.5, label_smoothing=0.1)
    assert smooth[0].item() == pytest.approx(-0.9 * _logsig(1.5) - 0.1 * _logsig(-1.5), abs=1e-6)


def test_simpo_registered_reference_free_with_gamma_and_rewards():
    assert needs_reference("simpo") is False
    c, r = torch.tensor([-2.0, -8.0]), torch.tensor([-6.0, -1.0])
    cl, rl = torch.tensor([2, 4]), torch.tensor([3, 1])
    # the reference passed is ignored: SimPO never looks at it
    per_pair, stats = preference_loss("simpo", c, r, torch.ones(2), torch.ones(2), cl, rl, 2.0,
                                      hyper={"simpo_gamma": 1.0, "unrelated": 3})
    assert per_pair.tolist() == pytest.approx([-_logsig(2.0 - 1.0), -_logsig(-2.0 - 1.0)], abs=1e-6)
    assert stats["rewards/chosen"].tolist() == pytest.approx([-2.0, -4.0])  # beta * mean logp
    assert stats["rewards/rejected"].tolist() == pytest.approx([-4.0, -2.0])
    assert stats["rewards/margins"].tolist() == pytest.approx([2.0, -2.0])
    assert stats["rewards/accuracies"].tolist() == [1.0, 0.0]
    # without hyper, TRL's default gamma 0.5; other losses take no hyper keys
    default, _ = preference_loss("simpo", c, r, None, None, cl, rl, 2.0)
    assert default[0].item() == pytest.approx(-_logsig(1.5), abs=1e-6)
    sig, _ = preference_loss("sigmoid", c, r, None, None, cl, rl, 0.1, hyper={"simpo_gamma": 1.0})
    assert sig[0].item() == pytest.approx(-_logsig(0.1 * 4.0), abs=1e-6)


def test_simpo_config_keys():
    from rl.config.fields import build
    from rl.errors import ConfigError
    from rl.trainers.dpo import DPOConfig

    cfg = build(DPOConfig, dict(model_name="x", loss_type="simpo", simpo_gamma=1.0, label_smoothing=0.1))
    assert cfg.uses_no_reference and cfg.simpo_gamma == 1.0
    with pytest.raises(ConfigError, match="label_smoothing"):
        build(DPOConfig, dict(model_name="x", loss_type="ipo", label_smoothing=0.1))
