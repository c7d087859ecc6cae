"""Policy-gradient losses on the sampled tokens (never over the whole vocabulary), and the value loss.

ONE registry kind, "policy_loss", ONE signature: each loss is the per-token term of its objective,

    fn(logp, old_logp, advantages, mask, p: LossParams) -> Term(per_token, ratio, clipped)

logp / old_logp / mask: (B, N) per-token log-probs of the current policy and of the sampler, mask 1 on
counted tokens (N = scored positions); advantages (B, N) per token or (B, 1) per sequence. `p` holds
every hyper-parameter by TRL's names (epsilon, epsilon_high, delta, ...). Term: per_token (B, N), the
loss before aggregation ((B, 1) from a sequence ratio and advantage, broadcast over the tokens); ratio
(B, N), or (B, 1) per sequence (GSPO), the importance ratio the KL factor and the metrics use; clipped
(like ratio) where the loss's clip acted.

`compute_policy_loss` is the one objective around a term, shared by PPO, the GRPO family and the
engine's `loss_fn="<name>"`: advantages broadcast, rollout-mismatch token weights, the optional k3
KL to a reference (GRPO's beta), the aggregation over tokens (`rl.algos.reduce.aggregate`) and the
metrics. A loss registers its default aggregation as the flag `normalization` (TRL's loss_type
meanings) and may register default `epsilon` / `epsilon_high` (GSPO's paper values); an explicit
argument always wins.

    name        term                                                          default aggregation
    ppo         -min(r A, clip(r, 1-eps, 1+eps_high) A); delta caps r first   token_mean
    dapo        the same term (TRL's default loss_type)                       token_mean (the step's)
    bnpo        the same term                                                 token_mean (this micro-batch)
    grpo        the same term                                                 sequence_mean
    dr_grpo     the same term                                                 constant (/ max_length)
    gspo        the same term on GSPO's sequence ratio s_i                    sequence_mean
    cispo       -sg(min(r, eps_high)) A logp (TRL, ScaleRL: eps_high a cap)   token_mean
    cispo_clip  -sg(clip(r, 1-eps, 1+eps_high)) A logp (MiniMax-M1, Tinker)   token_mean
    sapo        -sigmoid(tau (r - 1)) 4 / tau A (TRL's SAPO soft gate)        sequence_mean
    luspo       the clipped surrogate (TRL's LUSPO)                           sequence_sum (sum per sequence)
    vespo       -sg(phi(w_seq)) A logp, phi a gamma weight of the sequence   token_mean (the step's)
                ratio (TRL's VESPO; it takes the vLLM correction inside phi)
    importance_sampling  -r A (Tinker)                                        token_mean
    dro         -(logp A - dro_beta / 2 (logp - old_logp)^2) (Tinker)         token_mean

Metrics are detached scalars with TRL's names (`loss/policy`, `policy/clipfrac`, `policy/approx_kl`,
`policy/ratio_mean`, `clip_ratio/{low,high,region}_mean`, `kl`). Objectives follow Tinker's built-in
losses (tinker-docs: losses/{importance_sampling,ppo,cispo,dro}), TRL 1.16's GRPOTrainer._compute_loss
and the papers named at each term.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from rl.algos.kl import k2_kl, k3_kl
from rl.algos.reduce import aggregate, masked_mean
from rl.algos.registry import flag, get, register

KIND = "policy_loss"
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "constant", "sequence_sum")  # GRPO's `loss_aggregation` choices
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # GRPO's `importance_sampling_level` (TRL's name)


@dataclasses.dataclass(frozen=True)
class LossParams:
    """Every policy loss's hyper-parameters, TRL's names; a term reads the ones it needs."""
    epsilon: float = 0.2  # the ratio is clipped below at 1 - epsilon
    epsilon_high: float = 0.2  # ... above at 1 + epsilon_high (DAPO's clip-higher); cispo: the weight's cap
    delta: float | None = None  # two-sided clip: the unclipped ratio is capped at delta (INTELLECT-2)
    dro_beta: float = 0.05  # DRO's quadratic coefficient
    sapo_temperature_pos: float = 1.0  # SAPO's gate temperature for advantages > 0
    sapo_temperature_neg: float = 1.05  # ... and for advantages <= 0
    importance_sampling_level: str = "token"  # token | sequence (GSPO's length-normalised ratio)
    vespo_k_pos: float = 2.0  # VESPO's gamma weight phi(w) = e^lam w^k e^(-lam w): k and lam for A >= 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # ... and for A < 0
    vespo_lambda_neg: float = 2.0
    # the rollout-mismatch weights (B, N), for a term that folds them into its own weight (VESPO) instead of
    # having compute_policy_loss multiply its loss by them (flag `folds_token_weights`)
    token_weights: torch.Tensor | None = None


class Term(NamedTuple):
    per_token: torch.Tensor  # (B, N) loss before aggregation (or (B, 1), broadcast over the tokens)
    ratio: torch.Tensor  # (B, N) or (B, 1) per sequence
    clipped: torch.Tensor  # bool, like ratio (or (B, N)): where the clip acted


def per_token(x: torch.Tensor | float | None, like: torch.Tensor, name: str) -> torch.Tensor | None:
    """Broadcast a scalar or (B,) per-sequence tensor to `like` (B, N); check (B, N) shapes."""
    if x is None:
        return None
    x = torch.as_tensor(x, device=like.device, dtype=torch.float32)
    if x.dim() == 0:
        return x.expand_as(like)
    if x.dim() == 1:
        if x.shape[0] != like.shape[0]:
            raise ValueError(f"{name} has {x.shape[0]} entries but the batch has {like.shape[0]} sequences")
        return x[:, None].expand_as(like)
    if x.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(like.shape)} (per token, aligned "
                         f"with labels[:, 1:]) or ({like.shape[0]},) per sequence")
    return x


def ratio_metrics(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """policy/approx_kl (k2 of the ratio, TRL PPO's approxkl), policy/ratio_mean, policy/ratio_max."""
    logp, old_logp = logp.detach(), old_logp.detach()
    ratio = torch.exp(logp - old_logp)
    return {"policy/approx_kl": masked_mean(k2_kl(logp, old_logp), mask),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/ratio_max": torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max()}


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio (Zheng et al. 2025, eq. 7), (B, N) -> (B, 1):
        log s_i = 1/|y_i| sum_t (logp_t - old_logp_t)  over the sequence's counted tokens.
    Its gradient is the token mean of grad logp_t, so every token of a sequence shares one weight s_i."""
    mask = mask.to(logp.dtype)
    return (((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """r_t = exp(logp_t - old_logp_t) (B, N) at level "token", GSPO's s_i (B, 1) at level "sequence"."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be token or sequence, got {level!r}")
    return torch.exp(logp - old_logp if level == "token" else sequence_log_ratio(logp, old_logp, mask))


# ------------------------------------------------------------------------------ the registered terms

# decorators apply bottom-up: "ppo" is registered first (the order of names() and of --help)
@register(KIND, "dr_grpo", normalization="constant")
@register(KIND, "grpo", normalization="sequence_mean")
@register(KIND, "bnpo", normalization="token_mean", local_tokens=True)
@register(KIND, "dapo", normalization="token_mean")
@register(KIND, "ppo", normalization="token_mean")
def clipped_surrogate(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7; asymmetric clip: DAPO, Yu et al. 2025):
        loss_t = -min(r_t A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) A_t),  r_t = exp(logp - old_logp),
    with `delta` the unclipped r_t is capped at delta first (two-sided clip, INTELLECT-2, arXiv 2505.07291). At
    importance_sampling_level "sequence" r_t is GSPO's s_i. clipped: the clipped term is the minimum (no
    gradient there). TRL's grpo / dapo / bnpo / dr_grpo differ only in their aggregation."""
    ratio = importance_ratio(logp, old_logp, mask, p.importance_sampling_level)
    unclipped = (ratio if p.delta is None else torch.clamp(ratio, max=p.delta)) * advantages
    clipped = torch.clamp(ratio, 1.0 - p.epsilon, 1.0 + p.epsilon_high) * advantages
    return Term(-torch.min(unclipped, clipped), ratio, (clipped < unclipped).detach())


@register(KIND, "gspo", normalization="sequence_mean", epsilon=3e-4, epsilon_high=4e-4)
def gspo(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7): the clipped surrogate on one
    ratio per sequence, s_i = exp(1/|y_i| sum_t (logp_t - old_logp_t)), whatever importance_sampling_level
    says; the default sequence_mean is the paper's 1/G sum_i, the default clip range its (3e-4, 4e-4): a
    length-normalised ratio moves far less than a token's. TRL 1.16: importance_sampling_level="sequence"."""
    sequence_level = dataclasses.replace(p, importance_sampling_level="sequence")
    return clipped_surrogate(logp, old_logp, advantages, mask, sequence_level)


def _cispo(logp, advantages, ratio, low: float | None, high: float) -> Term:
    """CISPO's term (MiniMax-M1, Chen et al. 2025): loss_t = -sg(clip(r_t, low, high)) A_t logp_t; every
    token keeps its gradient, only the importance weight is clipped."""
    weight = torch.clamp(ratio, min=low, max=high).detach()
    out = (ratio > high) if low is None else (ratio < low) | (ratio > high)
    return Term(-weight * advantages * logp, ratio, out)


@register(KIND, "cispo", normalization="token_mean")
def cispo(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """CISPO as TRL 1.16 and ScaleRL (arXiv 2510.13786) write it: weight sg(min(r_t, epsilon_high)),
    epsilon_high an absolute cap on the ratio (ScaleRL recommends 5.0), no lower clip."""
    return _cispo(logp, advantages, importance_ratio(logp, old_logp, mask, p.importance_sampling_level),
                  None, p.epsilon_high)


@register(KIND, "cispo_clip", normalization="token_mean")
def cispo_clip(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """CISPO with the weight clipped to [1 - epsilon, 1 + epsilon_high] (Tinker's `cispo`; this package's
    `cispo` before TRL's meaning was adopted, and GRPO's former policy_loss=cispo)."""
    return _cispo(logp, advantages, importance_ratio(logp, old_logp, mask, p.importance_sampling_level),
                  1.0 - p.epsilon, 1.0 + p.epsilon_high)


@register(KIND, "sapo", normalization="sequence_mean")
def sapo(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """SAPO ("Soft Adaptive Policy Optimization", arXiv 2511.20347; TRL 1.16's loss_type="sapo"): a smooth gate
    instead of the hard clip, loss_t = -sigmoid(tau (r_t - 1)) 4 / tau A_t, tau = sapo_temperature_pos where
    A_t > 0 else sapo_temperature_neg; the loss's gradient is -r_t A_t sech^2(tau (r_t - 1) / 2) grad logp_t:
    the policy gradient -A_t grad logp_t at r = 1, fading smoothly off-policy. Nothing is clipped."""
    ratio = importance_ratio(logp, old_logp, mask, p.importance_sampling_level)
    tau = torch.where(advantages > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
    return Term(-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, ratio,
                torch.zeros_like(ratio, dtype=torch.bool))


@register(KIND, "luspo", normalization="sequence_sum")
def luspo(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """LUSPO (TRL 1.16's loss_type="luspo"): the clipped surrogate of `clipped_surrogate`, aggregated as the mean
    over sequences of each sequence's token sum (no length normalisation; TRL recommends
    importance_sampling_level="sequence", the paper's setup)."""
    return clipped_surrogate(logp, old_logp, advantages, mask, p)


LOG_W_MIN = math.log(1e-8)  # VESPO's clamp of log-weights, as TRL (and the paper's code) write it


@register(KIND, "vespo", normalization="token_mean", folds_token_weights=True)
def vespo(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """VESPO (TRL 1.16's loss_type="vespo"; GRPOTrainer.get_gamma_weights): loss_t = -sg(phi(w)) A logp_t with the
    sequence's importance weight w = exp(clamp(sum_t clamp(logp_t - old_t, -20, 20) + sum_t log v_t, log 1e-8, 20)),
    v_t the rollout-mismatch weights (folded in here, not multiplied onto the loss), and the gamma weight
    phi(w) = e^lam w^k e^(-lam w) (phi(1) = 1; k, lam = vespo_k_pos, vespo_lambda_pos where A >= 0, else the _neg
    ones). phi scales the policy gradient A grad logp; nothing is clipped."""
    mask = mask.to(logp.dtype)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    log_w = (log_ratio.detach() * mask).sum(-1, keepdim=True)
    if p.token_weights is not None:
        log_w = log_w + (torch.clamp(torch.log(p.token_weights.detach()), LOG_W_MIN, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, LOG_W_MIN, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, p.vespo_k_pos, p.vespo_k_neg)
    lam = torch.where(nonneg, p.vespo_lambda_pos, p.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    ratio = torch.exp(logp - old_logp)  # the token ratio: the KL factor (TRL's coef_1 at level token)
    return Term(-phi.detach() * advantages * logp, ratio, torch.zeros_like(ratio, dtype=torch.bool))


@register(KIND, "importance_sampling", normalization="token_mean")
def importance_sampling(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """REINFORCE with an importance weight (Tinker `importance_sampling`): loss_t = -(p/q * A_t); its gradient
    -A p/q grad log p is the unbiased off-policy policy gradient. Nothing is clipped."""
    ratio = importance_ratio(logp, old_logp, mask, p.importance_sampling_level)
    return Term(-ratio * advantages, ratio, torch.zeros_like(ratio, dtype=torch.bool))


@register(KIND, "dro", normalization="token_mean")
def dro(logp, old_logp, advantages, mask, p: LossParams) -> Term:
    """DRO (Richemond et al. 2024; Kimi k1.5; Tinker `dro`): loss_t = -(logp_t A_t - dro_beta/2 (logp_t -
    old_logp_t)^2); the quadratic term keeps the policy near the sampler. Token level only; nothing clipped."""
    ratio = torch.exp(logp - old_logp)
    return Term(-(logp * advantages - 0.5 * p.dro_beta * (logp - old_logp) ** 2), ratio,
                torch.zeros_like(ratio, dtype=torch.bool))


# ------------------------------------------------------------------------------ the one objective

def loss_params(loss_type: str, epsilon=None, epsilon_high=None, **rest) -> LossParams:
    """LossParams for `loss_type`: epsilon_high None is epsilon (TRL's rule); both None are the loss's
    registered defaults (GSPO's 3e-4 / 4e-4), else 0.2; the rest as given."""
    if epsilon is None and epsilon_high is None:
        epsilon = flag(KIND, loss_type, "epsilon", 0.2)
        epsilon_high = flag(KIND, loss_type, "epsilon_high", epsilon)
    elif epsilon is None:
        epsilon = flag(KIND, loss_type, "epsilon", 0.2)
    return LossParams(epsilon=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high, **rest)


def compute_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages, mask: torch.Tensor, *,
                        loss_type: str = "ppo", epsilon: float | None = None, epsilon_high: float | None = None,
                        delta: float | None = None, dro_beta: float = 0.05, sapo_temperature_pos: float = 1.0,
                        sapo_temperature_neg: float = 1.05, importance_sampling_level: str = "token",
                        vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
                        vespo_lambda_neg: float = 2.0,
                        normalization: str | None = None, num_items=None, max_length: int | None = None,
                        token_weights: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                        beta: float = 0.0, use_bias_correction_kl: bool = True) -> tuple[torch.Tensor, dict]:
    """The policy objective around the registered term `loss_type` (TRL 1.16's GRPO form):

        L = agg_t [ w_t * term_t + beta * r_t * k3_t ]

    Args:
        logp, old_logp, mask: (B, N); advantages: (B, N) per token, (B,) per sequence or a scalar.
        loss_type: a registered name (module docstring) or a user's `package.module:function` with the
            term signature. epsilon ... importance_sampling_level: `LossParams`.
        normalization: sum | token_mean | sequence_mean | constant (`rl.algos.reduce.aggregate`); None: the
            loss's registered default. num_items: token_mean's divisor (default: this micro-batch's token
            count; GRPO passes the step's count / micro-batches so accumulation is exact; bnpo ignores it).
            max_length: constant's divisor (max_completion_length).
        token_weights: (B, N) detached weights of the term (the rollout/trainer mismatch correction,
            `rl.algos.mismatch.importance_weights`), applied before the KL term as TRL does.
        ref_logp, beta, use_bias_correction_kl: the k3 KL to the reference, times the (differentiable) ratio
            r_t with the bias correction (unbiased reverse-KL gradient off-policy, DeepSeek-V3.2; TRL's default).
    Returns: (loss, metrics): loss/policy, policy/{clipfrac,approx_kl,ratio_mean,ratio_max},
        clip_ratio/{low,high,region}_mean (per sequence with a sequence ratio), kl when beta != 0.
    """
    term = get(KIND, loss_type)
    folds = flag(KIND, loss_type, "folds_token_weights", False)
    p = loss_params(loss_type, epsilon, epsilon_high, delta=delta, dro_beta=dro_beta,
                    sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                    importance_sampling_level=importance_sampling_level, vespo_k_pos=vespo_k_pos,
                    vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
                    token_weights=token_weights if folds else None)
    adv = per_token(advantages, logp, "advantages")
    if torch.is_tensor(advantages) and advantages.dim() == 1:
        adv = adv[:, :1]  # (B, 1), TRL's per-sequence layout: broadcast, with gradients equal to TRL's order
    mask = mask.to(logp.dtype)
    per_tok, ratio, clipped = term(logp, old_logp, adv, mask, p)
    if token_weights is not None and not folds:
        per_tok = per_tok * token_weights
    metrics: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (the reference model's per-token log-probs)")
        kl = k3_kl(logp, ref_logp)
        if use_bias_correction_kl:
            kl = kl * ratio
        per_tok = per_tok + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if flag(KIND, loss_type, "local_tokens", False):
        num_items = None  # bnpo: the token mean of this micro-batch (TRL's "bnpo")
    normalization = normalization or flag(KIND, loss_type, "normalization", "token_mean")
    loss = aggregate(per_tok, mask, normalization, num_items=num_items, max_length=max_length)
    metrics["loss/policy"] = loss.detach()
    with torch.no_grad():
        metrics.update(clip_metrics(ratio.detach(), clipped, adv, mask, p))
        metrics.update(ratio_metrics(logp, old_logp, mask))
    return loss, metrics


def clip_metrics(ratio, clipped, adv, mask, p: LossParams) -> dict:
    """policy/clipfrac (where the term's clip acted) and TRL GRPO's clip_ratio/{low,high,region}_mean
    (ratio below 1 - epsilon with A < 0, above 1 + epsilon_high with A > 0), over tokens, or over sequences
    (each counted once, TRL's sequence-level mean) when the ratio is one per sequence."""
    low = ((ratio < 1 - p.epsilon) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + p.epsilon_high) & (adv > 0)).to(mask.dtype)
    clipped = clipped.to(mask.dtype)
    if ratio.shape[-1] == mask.shape[-1]:
        count = mask
    else:  # a sequence ratio with per-sequence advantages: the same value along the row
        count = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
        low, high, clipped = (x.amax(-1, keepdim=True) for x in (low, high, clipped))
    out = {"policy/clipfrac": masked_mean(clipped, count), "clip_ratio/low_mean": masked_mean(low, count),
           "clip_ratio/high_mean": masked_mean(high, count),
           "clip_ratio/region_mean": masked_mean(torch.maximum(low, high), count)}
    if ratio.shape[-1] != mask.shape[-1]:
        out["policy/seq_ratio_mean"] = masked_mean(ratio, count)
    return out


GRPO_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              ref_logp: torch.Tensor | None = None, beta: float = 0.0, epsilon_low: float = 0.2,
              epsilon_high: float = 0.2, loss_aggregation: str | None = None,
              max_completion_length: int | None = None, num_items: float | None = None,
              use_bias_correction_kl: bool = True, importance_sampling_level: str = "token",
              loss_type: str = "dapo", token_weights: torch.Tensor | None = None, **params) -> tuple[torch.Tensor, dict]:
    """GRPO's objective (Shao et al. 2024, eq. 3; the per-token form TRL 1.16 implements) in GRPO's config
    names: `compute_policy_loss` with epsilon = epsilon_low, normalization = loss_aggregation (None: the
    loss type's own: dapo token_mean, grpo sequence_mean, dr_grpo constant), max_length =
    max_completion_length; `params` the loss's other hyper-parameters (delta, sapo_*, vespo_*: `LossParams`).
    Metrics: TRL GRPO's names (`GRPO_METRICS`)."""
    if loss_aggregation is not None and loss_aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}, got {loss_aggregation!r}")
    loss, metrics = compute_policy_loss(
        logp, old_logp, advantages, mask, loss_type=loss_type, epsilon=epsilon_low, epsilon_high=epsilon_high,
        importance_sampling_level=importance_sampling_level, normalization=loss_aggregation, num_items=num_items,
        max_length=max_completion_length, token_weights=token_weights, ref_logp=ref_logp, beta=beta,
        use_bias_correction_kl=use_bias_correction_kl, **params)
    return loss, {k: v for k, v in metrics.items() if k in GRPO_METRICS}


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor | None, returns: torch.Tensor,
                   mask: torch.Tensor, clip_range_value: float | None = 0.2, normalization: str = "token_mean",
                   ) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (the PPO2 baselines / TRL form): 0.5 * max((V - R)^2, (V_clip - R)^2).

    V_clip = clip(V, old_V - c, old_V + c), the same as old_V + clip(V - old_V, -c, c) in exact
    arithmetic; written this way V_clip is V itself wherever V is inside the range, so
    `value/clipfrac` (the fraction of tokens where the clipped error is the larger) counts only truly
    clipped tokens (the other form rounds to a different float on ~2% of unclipped fp32 tokens).
    values, old_values, returns, mask: (B, N) (or (B,) broadcast). With old_values None or
    clip_range_value None it is the plain 0.5 * (V - R)^2."""
    values = values.float()
    returns = per_token(returns, values, "returns")
    err = (values - returns) ** 2
    if old_values is not None and clip_range_value is not None:
        old_values = per_token(old_values, values, "old values")
        v_clip = torch.clamp(values, old_values - clip_range_value, old_values + clip_range_value)
        err_clip = (v_clip - returns) ** 2
        per_tok = 0.5 * torch.max(err, err_clip)
        vclipfrac = masked_mean((err_clip > err).float(), mask).detach()
    else:
        per_tok = 0.5 * err
        vclipfrac = values.new_zeros(())
    loss = aggregate(per_tok, mask, normalization)
    return loss, {"loss/value": loss.detach(), "value/clipfrac": vclipfrac,
                  "value/mean": masked_mean(values.detach(), mask)}
