"""GRPO's config schema and its batch arithmetic (the objective is documented in rl.trainers.grpo)."""

from __future__ import annotations

import dataclasses
from typing import Literal


from rl.algos import names
from rl.algos.off_policy import OFF_POLICY_CORRECTIONS
from rl.algos.policy_losses import IMPORTANCE_SAMPLING_LEVELS, KIND, LOSS_AGGREGATIONS
from rl.algos.registry import check, choices, flag
from rl.config.fields import opt
from rl.config.schema import OnlineConfig, RefSyncKeys
from rl.config.vocabulary import warn_deprecated
from rl.errors import ConfigError


_POLICY_LOSS_ALIASES = {"clip": None, "cispo": "cispo_clip"}  # the former policy_loss values (None: keep loss_type)


@dataclasses.dataclass
class GRPOConfig(RefSyncKeys, OnlineConfig):
    per_device_train_batch_size: int = opt(8, "GRPO: completions (not prompts) per device per micro-batch, as TRL; "
                                           "x gradient_accumulation_steps it holds whole groups of num_generations")
    num_generations: int = opt(8, "completions sampled per prompt (the group size G)")
    advantage_estimator: Literal[names("advantage_estimator")] = opt(
        "grpo", "grpo (group mean/std), dr_grpo (group mean only), rloo (leave-one-out), reinforce_pp (batch-normalised)")
    loss_type: str = opt("dapo", f"policy loss ({choices(KIND)}), TRL's GRPO names and meanings: dapo (clipped "
                         "surrogate, token mean over the step), grpo (sequence mean), dr_grpo (/ max_completion_length), "
                         "bnpo (token mean per micro-batch), cispo (weight capped at epsilon_high), sapo; also ppo, gspo, "
                         "cispo_clip (weight clipped to [1-epsilon, 1+epsilon_high]), importance_sampling, dro")
    loss_aggregation: Literal[LOSS_AGGREGATIONS] | None = opt(
        None, "token_mean (DAPO), sequence_mean (GRPO paper) or constant (Dr. GRPO: / max_completion_length); "
        "null: the loss_type's own")
    policy_loss: str | None = opt(None, "deprecated, use loss_type: clip is the default clipped "
                                  "surrogate, cispo is loss_type=cispo_clip")
    epsilon: float = opt(0.2, "clip the ratio below at 1 - epsilon (and above at 1 + epsilon unless epsilon_high)")
    epsilon_high: float | None = opt(None, "clip the ratio above at 1 + epsilon_high (null: epsilon, as TRL; DAPO "
                                     "recommends 0.28)")
    delta: float | None = opt(None, "two-sided clip: the unclipped ratio is capped at delta too (INTELLECT-2; null: "
                              "off)")
    sapo_temperature_pos: float = opt(1.0, "loss_type=sapo: the gate's temperature where the advantage is > 0")
    sapo_temperature_neg: float = opt(1.05, "loss_type=sapo: the gate's temperature where the advantage is <= 0")
    vespo_k_pos: float = opt(2.0, "loss_type=vespo: the gamma weight's power k where the advantage is >= 0")
    vespo_lambda_pos: float = opt(3.0, "loss_type=vespo: the gamma weight's decay lambda where the advantage is >= 0")
    vespo_k_neg: float = opt(3.0, "loss_type=vespo: k where the advantage is < 0")
    vespo_lambda_neg: float = opt(2.0, "loss_type=vespo: lambda where the advantage is < 0")
    beta: float = opt(0.0, "k3 KL penalty to the reference model; 0 loads no reference model")
    use_bias_correction_kl: bool = opt(True, "multiply the k3 term by the importance ratio (unbiased reverse-KL "
                                       "gradient, DeepSeek-V3.2; TRL 1.16's default)")
    num_iterations: int = opt(1, "policy updates per generated batch (mu in the GRPO paper)")
    importance_sampling_level: Literal[IMPORTANCE_SAMPLING_LEVELS] = opt(
        "token", "token (GRPO: a ratio per token) or sequence (GSPO, Zheng et al. 2025: one length-normalised "
        "ratio per completion, clipped per completion; the paper uses epsilon=3e-4 epsilon_high=4e-4)")
    dynamic_sampling: bool = opt(False, "DAPO dynamic sampling: drop prompt groups whose rewards are all equal "
                                 "(advantage 0) and sample more prompts until the step's batch is full")
    max_sampling_rounds: int = opt(3, "dynamic sampling: generation rounds per step at most (the first included); "
                                   "a batch still short after them is filled with dropped groups (dapo/filled_groups)")
    overlong_buffer: int = opt(0, "DAPO overlong shaping (eq. 13): completions longer than max_completion_length - "
                               "overlong_buffer tokens lose reward linearly, down to -overlong_penalty at the "
                               "maximum (0: off)")
    overlong_penalty: float = opt(1.0, "DAPO overlong shaping: the reward penalty at max_completion_length")
    share_prompt_forward: bool = opt(True, "training and scoring forwards compute each group's prompt once for its "
                                     "num_generations completions, packed without padding (rl.engine.packing."
                                     "pack_shared_prompts; same log-probs; SDPA models, else the padded batch)")
    max_staleness: int = opt(0, "asynchronous rollouts (TRL's name): the batch of step t is sampled by the policy of "
                             "step t - k at the oldest, while later steps train (a vLLM server samples meanwhile with "
                             "use_vllm=true vllm_mode=server); its behaviour log-probs correct the loss "
                             "(off_policy_correction); older samples are dropped (async/dropped_samples). 0: synchronous")
    mask_truncated_completions: bool = opt(False, "completions cut at max_completion_length (no EOS) carry no loss "
                                           "(DAPO's overlong filtering; their reward still counts in the group)")
    log_completions: bool = opt(False, "write the step's prompts, completions and rewards to completions.jsonl in "
                                "output_dir, every logging step")
    num_completions_to_print: int | None = opt(None, "log_completions: rows per step (null: all)")
    log_unique_prompts: bool = opt(False, "log_completions: one row per prompt (its first completion)")
    rollout_processes: int = opt(0, "the last N processes of the launch only sample (our sampler) while the others "
                                 "train; weights sent to them after each optimizer step (docs/rollout.md). 0: none")
    off_policy_correction: Literal[OFF_POLICY_CORRECTIONS] = opt(
        "behaviour", "max_staleness: the loss of a batch sampled by an older policy: behaviour (TRL's AsyncGRPO: the "
        "sampler's log-probs are the old policy of the clipped ratio) or decoupled (AReaL's decoupled PPO: the clip "
        "anchored at the current weights, each token weighted by pi_current / pi_behaviour)")
    rollout_dtype: Literal["float32", "bfloat16"] = opt(
        "float32", "our sampler's linear layers compute in this dtype: bfloat16 takes bf16 copies of the weights for "
        "each rollout (on a CPU with AVX512-BF16 or AMX, 1.3-1.5x the tokens/s of float32 on SmolLM2); its log-probs "
        "are then the bf16 model's, and their mismatch with the policy's is measured and corrected as vLLM's is "
        "(sampling/*, vllm_importance_sampling_*). With use_vllm=true vLLM's own dtype applies")
    behav_imp_weight_cap: float = opt(5.0, "off_policy_correction=decoupled: a token whose weight pi_current / "
                                      "pi_behaviour exceeds it leaves the loss (AReaL's name and filter)")

    def __post_init__(self):
        super().__post_init__()
        self.check_ref_sync()
        if self.policy_loss is not None:  # the former key of the per-token term (clip | cispo)
            if self.policy_loss not in _POLICY_LOSS_ALIASES:
                raise ConfigError(f"key 'policy_loss' is replaced by loss_type; set loss_type= one of "
                                  f"{', '.join(names(KIND))} (or package.module:function)")
            warn_deprecated("policy_loss", "loss_type")
            self.loss_type = _POLICY_LOSS_ALIASES[self.policy_loss] or self.loss_type
            self.policy_loss = None
        check(KIND, self.loss_type, "loss_type")
        if (self.loss_type == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction
                and not self.vllm_importance_sampling_mode.startswith("token")):
            raise ConfigError(f"loss_type=vespo folds the vLLM correction into its per-sequence weight, per token: "
                              f"set vllm_importance_sampling_mode to token_truncate or token_mask (TRL's rule), got "
                              f"{self.vllm_importance_sampling_mode}")
        if self.loss_aggregation is None:  # the loss type's own aggregation (TRL's loss_type meaning)
            self.loss_aggregation = flag(KIND, self.loss_type, "normalization", "token_mean")
            if self.loss_aggregation not in LOSS_AGGREGATIONS:
                raise ConfigError(f"key 'loss_aggregation': loss_type={self.loss_type} aggregates by "
                                  f"{self.loss_aggregation}; set loss_aggregation= one of {', '.join(LOSS_AGGREGATIONS)}")
        if self.num_generations < 2:
            raise ConfigError(f"key 'num_generations' must be at least 2 (the group is the baseline), "
                              f"got {self.num_generations}")
        per_process = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if per_process % self.num_generations:
            raise ConfigError(f"per_device_train_batch_size x gradient_accumulation_steps = {self.per_device_train_batch_size} x "
                              f"{self.gradient_accumulation_steps} = {per_process} completions per process must be "
                              f"a multiple of num_generations={self.num_generations} (whole groups per process)")
        if self.epsilon_high is None:  # TRL's rule: one epsilon clips both sides unless epsilon_high is given
            self.epsilon_high = self.epsilon
        for name in ("epsilon", "epsilon_high", "beta"):
            if getattr(self, name) < 0:
                raise ConfigError(f"key '{name}' must be >= 0, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"key 'temperature' must be >= 0, got {self.temperature}")
        if self.num_iterations < 1:
            raise ConfigError(f"key 'num_iterations' must be at least 1, got {self.num_iterations}")
        if self.max_sampling_rounds < 1:
            raise ConfigError(f"key 'max_sampling_rounds' must be at least 1, got {self.max_sampling_rounds}")
        if not 0 <= self.overlong_buffer <= self.max_completion_length:
            raise ConfigError(f"key 'overlong_buffer' must be between 0 and max_completion_length="
                              f"{self.max_completion_length}, got {self.overlong_buffer}")
        check_async(self)
        check_rollout_dtype(self)
        if self.overlong_penalty < 0:
            raise ConfigError(f"key 'overlong_penalty' must be >= 0 (it is subtracted), got {self.overlong_penalty}")


def check_rollout_dtype(cfg: GRPOConfig) -> None:
    """rollout_dtype: bfloat16 is our sampler's, and pays only where the CPU multiplies bf16 natively."""
    if cfg.rollout_dtype == "float32":
        return
    if cfg.use_vllm:
        raise ConfigError("rollout_dtype sets our sampler's precision; with use_vllm=true vLLM computes in its own "
                          "dtype: remove rollout_dtype (or set use_vllm=false)")
    import torch

    if not torch.cuda.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise ConfigError("rollout_dtype=bfloat16 needs a CPU with bf16 instructions (AVX512-BF16 or AMX) and this "
                          "one has none: bf16 would be emulated, slower than float32; remove rollout_dtype")


def check_async(cfg: GRPOConfig) -> None:
    """The asynchronous keys' one-line errors (what is supported is in docs/rollout.md)."""
    for name in ("max_staleness", "rollout_processes"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"key '{name}' must be >= 0, got {getattr(cfg, name)}")
    if cfg.max_staleness and cfg.num_iterations != 1:
        raise ConfigError(f"max_staleness={cfg.max_staleness} takes num_iterations=1 (each sampled batch is one "
                          f"update), got num_iterations={cfg.num_iterations}")
    if cfg.behav_imp_weight_cap <= 1:
        raise ConfigError(f"key 'behav_imp_weight_cap' must be > 1 (a weight of 1 is an on-policy token), got "
                          f"{cfg.behav_imp_weight_cap}")
    if cfg.rollout_processes and cfg.use_vllm:
        raise ConfigError("rollout_processes samples with our sampler in processes of the launch; with use_vllm=true "
                          "the vLLM server is the rollout process: start `rl vllm-serve --model <model_name>` and set "
                          "vllm_mode=server max_staleness=1 rollout_processes=0 (docs/rollout.md)")


def grpo_sizes(cfg: GRPOConfig, world: int, n_prompts: int | None = None) -> dict:
    """GRPO's batch arithmetic in its own units (also what --dry-run prints): completions per micro-batch
    (per_device_batch) and per optimizer step (global_batch), whole groups of num_generations each, so
    prompts per step = global_batch / num_generations; steps per pass over `n_prompts` data rows."""
    per_process = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    prompts_per_process = per_process // cfg.num_generations
    prompts_per_step = prompts_per_process * world
    return {"per_device_batch": cfg.per_device_train_batch_size, "global_batch": per_process * world,
            "completions_per_process": per_process, "prompts_per_process": prompts_per_process,
            "prompts_per_step": prompts_per_step,
            "steps_per_epoch": n_prompts // prompts_per_step if n_prompts is not None else None}
