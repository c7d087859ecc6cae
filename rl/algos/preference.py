"""Pairwise preference losses: the DPO family on policy log-probs, Bradley-Terry on reward-model scores.

For a prompt x with a chosen answer y_w and a rejected answer y_l, log pi(y|x) is the SUM of the
answer tokens' log-probs, and h = beta * [(log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))]:
    sigmoid:  -(1-eps) log sigmoid(h) - eps log sigmoid(-h)    DPO (Rafailov et al. 2023, eq. 7); eps > 0 is
                                                               conservative DPO (Mitchell 2023, label_smoothing)
    hinge:    max(0, 1 - h)                                    SLiC-HF (Zhao et al. 2023)
    ipo:      (h_avg/beta - 1/(2 beta))^2                      IPO (Azar et al. 2023, eq. 17), per-token averaged
                                                               log-ratios as TRL (what the IPO authors ran)
    orpo:     NLL(y_w) - beta * log sigmoid(log odds(y_w) - log odds(y_l))   ORPO (Hong et al. 2024, eq. 6),
                                                               per-token mean log-probs, no reference
    simpo:    -log sigmoid(beta (logp_w/|y_w| - logp_l/|y_l|) - gamma)   SimPO (Meng et al. 2024, eq. 6), no
                                                               reference; gamma = the config's simpo_gamma
    bt:       -log sigmoid(r_w - r_l - margin)                 Bradley-Terry on reward-model scores

The DPO-family losses are registered under "preference_loss" with one signature:
    fn(pair: PairLogps, beta, label_smoothing) -> (per_pair (B,), stats)
where stats may set "rewards/chosen"/"rewards/rejected" (default: beta * log-ratio) and add extras.
A loss with hyperparameters of its own names them with the flag `hyper=(names...)`; `preference_loss`
passes those keys of its `hyper` dict as keywords (SimPO: `simpo_gamma`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rl.algos.registry import flag, get, register

KIND = "preference_loss"


class PairLogps(NamedTuple):
    """One batch of pairs, every field (B,): answer log-prob sums and answer token counts.
    A reference of None means reference-free (its log-probs count as 0)."""
    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor

    def logratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log pi - log ref, (B,) each."""
        return (self.chosen - (self.ref_chosen if self.ref_chosen is not None else 0.0),
                self.rejected - (self.ref_rejected if self.ref_rejected is not None else 0.0))


# ---------------------------------------------------------------------------- the equations

def sigmoid_loss(delta: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO / conservative DPO per pair.

    delta (B,): chosen log-ratio minus rejected log-ratio (sums over answer tokens).
    label_smoothing eps: probability that a preference label is flipped (cDPO); 0 gives plain DPO.
    Returns (B,) = -(1-eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta).
    """
    h = beta * delta
    return -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def hinge_loss(delta: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC-HF hinge per pair: (B,) = relu(1 - beta delta)."""
    return torch.relu(1.0 - beta * delta)


def ipo_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, chosen_lengths: torch.Tensor,
             rejected_lengths: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO per pair (Azar et al. 2023, eq. 17) on per-token averaged log-ratios (as TRL).

    All inputs (B,); lengths = answer tokens counted. beta is the paper's tau.
    Returns (B,) = (chosen/len_c - rejected/len_r - 1/(2 beta))^2.
    """
    d = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
    return (d - 1.0 / (2.0 * beta)) ** 2


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(mean_logps) < 1; (B,) -> (B,). log(1-p) via expm1 for accuracy."""
    return mean_logps - torch.log(-torch.expm1(mean_logps.clamp(max=-1e-6)))


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
              rejected_lengths: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO per pair (Hong et al. 2024, eq. 6-7): mean-token NLL of the chosen answer plus
    beta * -log sigmoid(log odds(chosen) - log odds(rejected)), odds of the per-token mean probability.

    Inputs (B,) sums of answer log-probs and answer lengths.
    Returns (loss (B,), nll (B,), log-odds ratio (B,)).
    """
    c_mean = chosen_logps / chosen_lengths.clamp(min=1)
    r_mean = rejected_logps / rejected_lengths.clamp(min=1)
    ratio = log_odds(c_mean) - log_odds(r_mean)
    nll = -c_mean
    return nll - beta * F.logsigmoid(ratio), nll, ratio


def simpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
               rejected_lengths: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """SimPO per pair (Meng et al. 2024, eq. 6): length-normalised log-likelihood margin, no reference.

    Inputs (B,) sums of answer log-probs and answer lengths; gamma is the target reward margin.
    Returns (B,) = -(1-eps) log sigmoid(h) - eps log sigmoid(-h), h = beta (c/len_c - r/len_r) - gamma
    (eps = label_smoothing, as TRL's CPOTrainer; 0 is the paper's loss).
    """
    h = beta * (chosen_logps / chosen_lengths.clamp(min=1) - rejected_logps / rejected_lengths.clamp(min=1)) - gamma
    return -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> tuple[torch.Tensor, dict]:
    """Bradley-Terry pairwise loss of a reward model, as TRL's RewardTrainer computes it.

    Args:
        chosen, rejected: (B,) rewards of the preferred and the rejected answer.
        margin: optional (B,) required reward gap (Llama 2 paper, sec. 3.2.2); the loss is
            -logsigmoid(r_c - r_r - margin).
        center_rewards_coefficient: optional weight of mean((r_c + r_r)^2), which keeps rewards
            centred on zero (Eisenstein et al. 2023, "Helping or herding?").
    Returns:
        (scalar loss, metrics) with `accuracy` = mean(r_c > r_r) (ties count as wrong, as in TRL)
        and `margin` = mean(r_c - r_r).
    """
    diff = chosen - rejected
    loss = -F.logsigmoid(diff - margin if margin is not None else diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        metrics = {"accuracy": (chosen > rejected).float().mean(), "margin": diff.mean()}
    return loss, metrics


# ---------------------------------------------------------------------------- registered DPO family

@register(KIND, "sigmoid")
def _sigmoid(pair: PairLogps, beta: float, label_smoothing: float = 0.0):
    c, r = pair.logratios()
    return sigmoid_loss(c - r, beta, label_smoothing), {}


@register(KIND, "ipo")
def _ipo(pair: PairLogps, beta: float, label_smoothing: float = 0.0):  # noqa: ARG001
    c, r = pair.logratios()
    return ipo_loss(c, r, pair.chosen_lengths, pair.rejected_lengths, beta), {}


@register(KIND, "hinge")
def _hinge(pair: PairLogps, beta: float, label_smoothing: float = 0.0):  # noqa: ARG001
    c, r = pair.logratios()
    return hinge_loss(c - r, beta), {}


@register(KIND, "orpo", needs_reference=False)
def _orpo(pair: PairLogps, beta: float, label_smoothing: float = 0.0):  # noqa: ARG001
    per_pair, nll, ratio = orpo_loss(pair.chosen, pair.rejected, pair.chosen_lengths, pair.rejected_lengths, beta)
    # no reference: the "rewards" are beta * mean answer log-prob (TRL's ORPO)
    return per_pair, {"rewards/chosen": beta * pair.chosen.detach() / pair.chosen_lengths.clamp(min=1),
                      "rewards/rejected": beta * pair.rejected.detach() / pair.rejected_lengths.clamp(min=1),
                      "nll_loss": nll.detach(), "log_odds_ratio": ratio.detach()}


@register(KIND, "simpo", needs_reference=False, hyper=("simpo_gamma",))
def _simpo(pair: PairLogps, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5):
    per_pair = simpo_loss(pair.chosen, pair.rejected, pair.chosen_lengths, pair.rejected_lengths, beta,
                          simpo_gamma, label_smoothing)
    # no reference: the "rewards" are beta * mean answer log-prob (TRL's CPOTrainer, loss_type="simpo")
    return per_pair, {"rewards/chosen": beta * pair.chosen.detach() / pair.chosen_lengths.clamp(min=1),
                      "rewards/rejected": beta * pair.rejected.detach() / pair.rejected_lengths.clamp(min=1)}


def needs_reference(loss_type: str) -> bool:
    """Whether the registered preference loss compares against a reference model (ORPO does not; a user's
    `module:function` does unless registered with needs_reference=False)."""
    return bool(flag(KIND, loss_type, "needs_reference", True))


def preference_loss(loss_type: str, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                    ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None,
                    chosen_lengths: torch.Tensor, rejected_lengths: torch.Tensor, beta: float,
                    label_smoothing: float = 0.0, hyper: dict | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses of the registered `loss_type` and TRL-named per-pair statistics.

    All tensors (B,). A missing reference (None) means reference-free: its log-probs count as 0.
    Returns (losses (B,), stats) with stats rewards/chosen, rewards/rejected, rewards/accuracies,
    rewards/margins, logps/chosen, logps/rejected (each (B,), detached) and the loss's extras (ORPO:
    nll_loss, log_odds_ratio). `hyper`: the config's loss hyperparameters; the keys the loss registered
    with `hyper=(...)` are passed to it (others ignored).
    """
    pair = PairLogps(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths,
                     rejected_lengths)
    own = {k: hyper[k] for k in flag(KIND, loss_type, "hyper", ()) if hyper and k in hyper}
    per_pair, stats = get(KIND, loss_type)(pair, beta, label_smoothing, **own)
    c, r = pair.logratios()
    chosen_rewards = stats.pop("rewards/chosen", None)
    rejected_rewards = stats.pop("rewards/rejected", None)
    chosen_rewards = beta * c.detach() if chosen_rewards is None else chosen_rewards
    rejected_rewards = beta * r.detach() if rejected_rewards is None else rejected_rewards
    stats.update({
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen_logps.detach(),
        "logps/rejected": rejected_logps.detach(),
    })
    return per_pair, stats
