"""Reward models: standard (Bradley-Terry), pairwise and multi-objective, full, LoRA or 4-bit QLoRA.

Objective (Bradley-Terry preference model; Ouyang et al. 2022, eq. 1; Christiano et al. 2017):
    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin)
         + center_rewards_coefficient * mean((r_chosen + r_rejected)^2)      (Eisenstein et al. 2023)
exactly TRL 1.16's `RewardTrainer.compute_loss` (checked against it in tests/test_reward.py), with
TRL's metric names (`loss`, `accuracy`, `margin`, `mean_reward`, `min_reward`, `max_reward`) plus
`std_reward` and `rewards/chosen`, `rewards/rejected`.

A `RewardModel` is a transformer backbone (the base model of `AutoModelForSequenceClassification`)
plus a linear head on one pooled hidden state, divided by `temperature`. Deviations from the
reference implementation, all deliberate (see shared/reference/README.md, "traps"):
* `last` pooling picks the last *real* token from the attention mask, so left and right padding give
  the same reward; position ids are derived from the mask for the same reason. `cls` is the first
  real token, `mean` a masked mean.
* LoRA targets every linear layer by default (GPT-2's Conv1D included), not only q_proj/v_proj.
* Checkpoints are safetensors plus JSON, never pickles. A full fine-tune is written in the layout of
  `AutoModelForSequenceClassification` (with `temperature` folded into `score.weight`), so it loads
  without this package; with `pooling_strategy="last"` that model gives the same rewards.
* Texts are `prompt + answer + eos` (TRL's format); too-long texts lose their *beginning*, so the
  answer's end, where `last` pooling reads, survives truncation.

`load_reward_model(path)` gives the frozen model with `score(texts) -> (B,)` that PPO/GRPO use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from rl.algos.preference import bradley_terry_loss
from rl.config import ConfigError, TrainConfig, opt
from rl.trainers.base import CallbackTracker, Trainer
from rl.generation import position_ids_from_mask

logger = logging.getLogger(__name__)

FORMAT = "rl-reward-model"
CONFIG_FILE = "reward_config.json"
HEAD_FILE = "reward_head.safetensors"
ADAPTER_FILE = "adapter.safetensors"
HF_WEIGHTS_FILE = "model.safetensors"


# ==================================================================================================
# Pure math (the Bradley-Terry loss is in rl.algos.preference, importable from here)
# ==================================================================================================

def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean squared error over the unmasked entries of a (B, K) regression.

    Args:
        pred, target: (B, K). Masked entries of `target` may hold anything, NaN included.
        mask: None (all entries), (K,) per objective, or (B, K) per entry; nonzero = trained.
    Returns:
        (loss, per_objective): the mean over all unmasked entries (a zero that still has a grad_fn
        when everything is masked) and the (K,) mean per objective (0 where none is unmasked).
    """
    if mask is None:
        mask = torch.ones_like(pred, dtype=torch.bool)
    mask = mask.to(pred.device).bool()
    if mask.dim() == 1:
        if mask.shape[0] != pred.shape[1]:
            raise ValueError(f"objective_mask has {mask.shape[0]} entries but there are {pred.shape[1]} objectives")
        mask = mask.unsqueeze(0).expand_as(pred)
    elif mask.shape != pred.shape:
        raise ValueError(f"objective_mask shape {tuple(mask.shape)} must be (K,) or (B, K) = {tuple(pred.shape)}")
    if target.shape != pred.shape:
        raise ValueError(f"target_rewards shape {tuple(target.shape)} must be (B, K) = {tuple(pred.shape)}")
    # Masked targets are replaced before the subtraction: a NaN there would otherwise reach the
    # gradient (0 * NaN) even through where().
    target = torch.where(mask, target.to(pred.dtype), pred.detach())
    sq = torch.where(mask, (pred - target) ** 2, torch.zeros_like(pred))
    count = mask.sum()
    loss = sq.sum() / count.clamp(min=1)  # all masked: 0 * pred, connected to the graph
    per_objective = sq.sum(0) / mask.sum(0).clamp(min=1)
    return loss, per_objective


def pool_hidden(hidden: torch.Tensor, attention_mask: torch.Tensor, strategy: str) -> torch.Tensor:
    """One vector per sequence from (B, T, H) hidden states and a (B, T) 0/1 mask -> (B, H).

    `last`: the last position whose mask is 1, `cls`: the first such position, `mean`: the masked
    mean. Taken from the mask, not from the lengths, so left and right padding agree."""
    mask = attention_mask.to(hidden.device)
    B, T = mask.shape
    if strategy == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)
    positions = torch.arange(T, device=hidden.device).expand(B, T)
    if strategy == "last":
        idx = (positions * (mask > 0)).argmax(-1)
    elif strategy == "cls":
        idx = (mask > 0).int().argmax(-1)  # argmax returns the first maximum
    else:
        raise ValueError(f"unknown pooling_strategy {strategy!r}; use last, mean or cls")
    return hidden[torch.arange(B, device=hidden.device), idx]




# ==================================================================================================
# Config
# ==================================================================================================

@dataclass
class RewardModelConfig:
    """The reference's fields, plus quantisation, LoRA targets, lengths and the loss options."""

    model_name: str = field(default="tiny:llama", metadata={"help": "HF id, local path or tiny:<family>"})
    num_labels: int = field(default=1, metadata={"help": "outputs of the head (1 for a scalar reward)"})
    pooling_strategy: Literal["last", "mean", "cls"] = field(
        default="last", metadata={"help": "hidden state read by the head: last real token, masked mean, first token"})
    dropout_prob: float = field(default=0.1, metadata={"help": "dropout on the pooled state (training only)"})
    temperature: float = field(default=1.0, metadata={"help": "rewards are divided by this"})
    use_lora: bool = field(default=True, metadata={"help": "train LoRA adapters + head instead of all weights"})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scale alpha / r)"})
    lora_dropout: float = field(default=0.1, metadata={"help": "dropout on the LoRA input"})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "'all-linear' (works for GPT-2, Llama, Qwen2, Gemma) or a comma list"})
    load_in_4bit: bool = field(default=False, metadata={"help": "NF4 backbone through bitsandbytes (QLoRA)"})
    load_in_8bit: bool = field(default=False, metadata={"help": "int8 backbone through bitsandbytes"})
    learning_rate: float = field(default=1e-4, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=100, metadata={"help": "linear warmup steps (capped at the run length)"})
    warmup_ratio: float | None = field(default=None, metadata={"help": "warmup as a fraction of the steps; wins over warmup_steps"})
    lr_scheduler: Literal["constant", "linear", "cosine"] = field(default="linear", metadata={"help": "after warmup"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_grad_norm: float | None = field(default=1.0, metadata={"help": "gradient clipping (None: off)"})
    max_length: int = field(default=512, metadata={"help": "tokens per text; longer texts lose their beginning"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    center_rewards_coefficient: float | None = field(default=None, metadata={"help": "weight of mean((r_c+r_r)^2)"})
    append_eos: bool = field(default=True, metadata={"help": "end every text with EOS (TRL's format)"})
    dtype: str = field(default="auto", metadata={"help": "float32, bfloat16, float16 or auto"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in backward"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run model code from the checkpoint"})
    seed: int = field(default=42, metadata={"help": "shuffling and eval-split seed"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N optimizer steps (0: at the end)"})
    log_every: int = field(default=1, metadata={"help": "log metrics every N optimizer steps"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N optimizer steps (0: only the final model)"})
    save_total_limit: int | None = field(default=None, metadata={"help": "keep only the newest N checkpoints"})
    resume: str | None = field(default=None, metadata={"help": "'auto' or a checkpoint path to resume training from"})

    def __post_init__(self):
        if self.num_labels < 1:
            raise ConfigError(f"num_labels must be at least 1, got {self.num_labels}")
        if self.pooling_strategy not in ("last", "mean", "cls"):
            raise ConfigError(f"pooling_strategy must be last, mean or cls, got {self.pooling_strategy!r}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.dropout_prob < 1.0:
            raise ConfigError(f"dropout_prob must be in [0, 1), got {self.dropout_prob}")
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_4bit and load_in_8bit are both true; choose one")
        if (self.load_in_4bit or self.load_in_8bit) and not self.use_lora:
            raise ConfigError("quantized weights cannot be trained directly: set use_lora=true with "
                              "load_in_4bit/load_in_8bit (QLoRA)")
        if self.gradient_accumulation_steps < 1 or self.max_length < 2:
            raise ConfigError("gradient_accumulation_steps must be >= 1 and max_length >= 2")
        if self.warmup_ratio is not None and not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    @property
    def quantization(self) -> str | None:
        return "4bit" if self.load_in_4bit else "8bit" if self.load_in_8bit else None


# ==================================================================================================
# Models
# ==================================================================================================

class RewardOutput(dict):
    """Forward result; keys readable as attributes (`out.rewards`, `out["rewards"]`)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class RewardModel(nn.Module):
    """Backbone + dropout + linear head on a pooled hidden state; rewards (B, num_labels) / temperature."""

    head_bias = False  # as HF's `score` layer, so a full fine-tune saves as a sequence classifier

    def __init__(self, config: RewardModelConfig, tokenizer=None):
        super().__init__()
        from rl.models import apply_lora, load_causal_lm

        self.config = config
        self.tokenizer = tokenizer
        hf = load_causal_lm(config.model_name, dtype=config.dtype, trust_remote_code=config.trust_remote_code,
                            gradient_checkpointing=False, quantization=config.quantization,
                            task="classifier", num_labels=config.num_labels)
        self.hf_config = hf.config  # written next to full fine-tunes for AutoModelForSequenceClassification
        self.hf_prefix = hf.base_model_prefix
        self.hf_config.architectures = [type(hf).__name__]
        backbone = getattr(hf, self.hf_prefix)
        hidden = hf.config.get_text_config().hidden_size
        score = getattr(hf, "score", None)
        if (isinstance(score, nn.Linear) and score.bias is None and score.out_features == config.num_labels
                and not self.head_bias):
            head = score  # keep HF's initialisation and key name
        else:
            head = nn.Linear(hidden, config.num_labels, bias=self.head_bias)
            nn.init.normal_(head.weight, std=getattr(hf.config, "initializer_range", 0.02))
            if head.bias is not None:
                nn.init.zeros_(head.bias)
        head.to(torch.float32 if config.quantization else next(backbone.parameters()).dtype)
        if config.gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.quantization:
            from peft import prepare_model_for_kbit_training

            # Freezes the quantized weights and upcasts norms; adapters and head stay trainable.
            backbone = prepare_model_for_kbit_training(
                backbone, use_gradient_checkpointing=config.gradient_checkpointing)
        if config.use_lora:
            backbone = apply_lora(backbone, rank=config.lora_rank, alpha=config.lora_alpha,
                                  dropout=config.lora_dropout, target_modules=config.lora_target_modules,
                                  task_type=None)
        self.backbone = backbone
        self.dropout = nn.Dropout(config.dropout_prob)
        self.head = head
        self.pad_token_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    # ------------------------------------------------------------------ forward
    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H) pooled hidden state of the last layer."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return pool_hidden(hidden, attention_mask, self.config.pooling_strategy)

    def rewards(self, input_ids, attention_mask=None) -> torch.Tensor:
        """(B, num_labels) rewards divided by the temperature."""
        h = self.dropout(self.pooled(input_ids, attention_mask))
        return self.head(h.to(self.head.weight.dtype)).float() / self.config.temperature

    def forward(self, input_ids, attention_mask=None, **kwargs) -> RewardOutput:
        r = self.rewards(input_ids, attention_mask)
        return RewardOutput(rewards=r, logits=r)

    # ------------------------------------------------------------------ scoring texts
    def get_tokenizer(self):
        if self.tokenizer is None:
            from rl.models import load_tokenizer

            self.tokenizer = load_tokenizer(self.config.model_name, self.config.trust_remote_code)
        return self.tokenizer

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, formatted and truncated exactly as in training."""
        return encode_texts(self.get_tokenizer(), texts, self.config.max_length, self.config.append_eos)

    def scalar(self, out: RewardOutput) -> torch.Tensor:
        """(B,) scalar reward from a forward output."""
        if self.config.num_labels != 1:
            raise ValueError(f"a scalar reward needs num_labels=1, this model has {self.config.num_labels}")
        return out["rewards"][:, 0]

    @torch.no_grad()
    def score(self, texts: Sequence[str], batch_size: int = 16) -> torch.Tensor:
        """Scalar reward of each text (prompt + response as one string): float32 (B,) on the CPU."""
        if isinstance(texts, str):
            texts = [texts]
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        ids = self.encode(texts)
        out = []
        for s in range(0, len(ids), batch_size):
            input_ids, mask = pad_batch(ids[s:s + batch_size], self.pad_token_id)
            out.append(self.scalar(self(input_ids.to(device), mask.to(device))).float().cpu())
        self.train(was_training)
        return torch.cat(out) if out else torch.zeros(0)

    # ------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict:
        return {"format": FORMAT, "version": 1, "kind": type(self).__name__,
                "config": dataclasses.asdict(self.config)}

    def save(self, path: str | Path, state_dict: dict | None = None) -> Path:
        """Write this model to directory `path` (see `save_reward_model`)."""
        return save_reward_model(self, path, state_dict)

    def load_weights(self, path: str | Path) -> None:
        """Load head and adapters (LoRA) or all weights (full) saved by `save` into this model."""
        from safetensors.torch import load_file

        path = Path(path)
        meta = json.loads((path / CONFIG_FILE).read_text())
        sd = {f"head.{k}": v for k, v in load_file(str(path / HEAD_FILE)).items()}
        if meta["weights"] == "lora":
            if not self.config.use_lora:
                raise ValueError(f"{path} holds LoRA adapters but this model has use_lora=false")
            sd.update({f"backbone.{k}": v for k, v in load_file(str(path / ADAPTER_FILE)).items()})
        else:
            if self.config.use_lora:
                raise ValueError(f"{path} holds a full model but this model has use_lora=true; "
                                 f"load it with load_reward_model({str(path)!r})")
            prefix = meta["hf_prefix"] + "."
            sd.update({"backbone." + k[len(prefix):]: v for k, v in load_file(str(path / HF_WEIGHTS_FILE)).items()
                       if k.startswith(prefix)})
        _load_partial(self, sd)


class PairwiseRewardModel(RewardModel):
    """Bradley-Terry comparison of two texts: logit P(A preferred over B) = r(A) - r(B)."""

    def forward_pair(self, input_ids_a, attention_mask_a, input_ids_b, attention_mask_b) -> torch.Tensor:
        """(B,) logit that A is preferred; A and B go through the backbone as one batch of 2B rows,
        so any B >= 1 works and both sides see the same dropout mode."""
        ids, mask = _stack_pair(input_ids_a, attention_mask_a, input_ids_b, attention_mask_b, self.pad_token_id)
        r = self.rewards(ids, mask)[:, 0]
        n = input_ids_a.shape[0]
        return r[:n] - r[n:]

    def compute_bradley_terry_loss(self, input_ids_a, attention_mask_a, input_ids_b, attention_mask_b,
                                   labels) -> torch.Tensor:
        """Binary cross-entropy of `labels` (B,) (1: A preferred, 0: B preferred; soft labels allowed)
        on the pair logit; equals -logsigmoid(r_A - r_B) when every label is 1."""
        logit = self.forward_pair(input_ids_a, attention_mask_a, input_ids_b, attention_mask_b)
        labels = torch.as_tensor(labels, device=logit.device, dtype=logit.dtype).reshape(-1)
        if labels.shape != logit.shape:
            raise ValueError(f"labels must have one entry per pair ({logit.shape[0]}), got {tuple(labels.shape)}")
        return F.binary_cross_entropy_with_logits(logit, labels)


class MultiObjectiveRewardModel(RewardModel):
    """K reward heads (helpfulness, safety, ...) and their weighted sum.

    The head has a bias here: the objectives are regressed on targets, not only compared."""

    head_bias = True

    def __init__(self, config: RewardModelConfig, num_objectives: int = 3,
                 objective_weights: Sequence[float] | None = None, tokenizer=None):
        if num_objectives < 1:
            raise ConfigError(f"num_objectives must be at least 1, got {num_objectives}")
        weights = list(objective_weights) if objective_weights is not None else [1.0 / num_objectives] * num_objectives
        if len(weights) != num_objectives:
            raise ConfigError(f"objective_weights has {len(weights)} entries but num_objectives={num_objectives}")
        # A copy: the caller's config keeps its own num_labels.
        super().__init__(dataclasses.replace(config, num_labels=num_objectives), tokenizer=tokenizer)
        self.num_objectives = num_objectives
        self.register_buffer("objective_weights", torch.tensor(weights, dtype=torch.float32))

    def forward(self, input_ids, attention_mask=None, return_all_objectives: bool = True, **kwargs):
        """`rewards` (B, K) and `combined_reward` (B, 1) = rewards @ weights; without
        `return_all_objectives` only the combined reward tensor (B, 1)."""
        r = self.rewards(input_ids, attention_mask)
        combined = r @ self.objective_weights.to(r.device).unsqueeze(-1)
        if not return_all_objectives:
            return combined
        return RewardOutput(rewards=r, combined_reward=combined, logits=r)

    def scalar(self, out) -> torch.Tensor:
        return (out["combined_reward"] if isinstance(out, dict) else out)[:, 0]

    def compute_multi_objective_loss(self, input_ids, attention_mask, target_rewards,
                                     objective_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked MSE of the K rewards against `target_rewards` (B, K); see `masked_mse`.
        Returns (loss, per_objective_losses (K,))."""
        r = self.rewards(input_ids, attention_mask)
        return masked_mse(r, torch.as_tensor(target_rewards, device=r.device), objective_mask)

    def _meta(self) -> dict:
        meta = super()._meta()
        meta["num_objectives"] = self.num_objectives
        meta["objective_weights"] = self.objective_weights.tolist()
        return meta


# ==================================================================================================
# Tokens and batches
# ==================================================================================================

def encode_texts(tokenizer, texts: Sequence[str], max_length: int, append_eos: bool = True) -> list[list[int]]:
    """Token ids per text (+ EOS), keeping the last `max_length` tokens when too long."""
    enc = tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
    eos = tokenizer.eos_token_id
    out = []
    for ids in enc:
        ids = list(ids)
        if append_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        out.append(ids[-max_length:])
    return out


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and 0/1 mask from lists of ids."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(list(s), dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def _stack_pair(ids_a, mask_a, ids_b, mask_b, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate two (B, Ta) / (B, Tb) batches along the batch, right-padding the shorter."""
    if mask_a is None:
        mask_a = torch.ones_like(ids_a)
    if mask_b is None:
        mask_b = torch.ones_like(ids_b)
    if ids_a.dim() == 1:  # a single unbatched pair
        ids_a, mask_a, ids_b, mask_b = (t.unsqueeze(0) for t in (ids_a, mask_a, ids_b, mask_b))
    if ids_a.shape[0] != ids_b.shape[0]:
        raise ValueError(f"A and B must have the same batch size, got {ids_a.shape[0]} and {ids_b.shape[0]}")
    T = max(ids_a.shape[1], ids_b.shape[1])

    def pad(t, value):
        return F.pad(t, (0, T - t.shape[1]), value=value)

    return (torch.cat([pad(ids_a, pad_id), pad(ids_b.to(ids_a.device), pad_id)]),
            torch.cat([pad(mask_a, 0), pad(mask_b.to(mask_a.device), 0)]))


# ==================================================================================================
# Saving and loading
# ==================================================================================================

def _is_zero3_param(p) -> bool:
    return hasattr(p, "ds_id")


def _load_partial(model: nn.Module, sd: dict) -> None:
    """Load `sd` into `model` (keys relative to it); every key must exist. ZeRO-3 aware."""
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    unknown = [k for k in sd if k not in own]
    if unknown:
        raise KeyError(f"checkpoint has weights this model lacks (different base model or LoRA "
                       f"settings?): {unknown[:3]}")
    params = [own[k] for k in sd if isinstance(own[k], nn.Parameter)]
    ctx = _gathered(params, modifier_rank=0) if any(_is_zero3_param(p) for p in params) else _null()
    with ctx, torch.no_grad():
        for k, v in sd.items():
            own[k].data.copy_(v.to(own[k].device, own[k].dtype).reshape(own[k].shape))


def _gathered(params, modifier_rank=None):
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def save_reward_model(model: RewardModel, path: str | Path, state_dict: dict | None = None) -> Path:
    """Write `model` to directory `path`: safetensors + JSON only.

    * `reward_config.json`: kind, RewardModelConfig, objective weights, what else is in the dir.
    * `reward_head.safetensors`: the head, exactly.
    * LoRA (incl. QLoRA): `adapter.safetensors`, the adapter weights only; the base model is
      reloaded from `config.model_name` (quantized again if it was).
    * full fine-tune: `config.json` + `model.safetensors` in the layout of
      `AutoModelForSequenceClassification` (head / temperature in `score.weight`) + tokenizer.

    `state_dict` (the model's full state dict, e.g. gathered under ZeRO-3) defaults to the model's.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = state_dict if state_dict is not None else model.state_dict()
    sd = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
    meta = model._meta()
    head = {k[len("head."):]: v.clone() for k, v in sd.items() if k.startswith("head.")}
    save_file(head, str(path / HEAD_FILE))
    if model.config.use_lora:
        adapter = {k[len("backbone."):]: v.clone() for k, v in sd.items()
                   if k.startswith("backbone.") and "lora_" in k}
        save_file(adapter, str(path / ADAPTER_FILE))
        meta.update(weights="lora", hf_compatible=False)
    else:
        prefix = model.hf_prefix
        hf_sd = {f"{prefix}.{k[len('backbone.'):]}": v.clone() for k, v in sd.items() if k.startswith("backbone.")}
        w = head["weight"]
        hf_sd["score.weight"] = (w.float() / model.config.temperature).to(w.dtype)
        save_file(hf_sd, str(path / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        hf_cfg = model.hf_config
        hf_cfg.num_labels = model.config.num_labels
        hf_cfg.save_pretrained(str(path))
        # HF's classifier reads the last token that is not the pad id, with a bias-free head: our
        # rewards exactly when pooling is `last`, the head has no bias, and the EOS ending each text
        # is not the pad id (with pad == eos, as in SmolLM2, HF reads the token before that EOS).
        eos = hf_cfg.eos_token_id if isinstance(hf_cfg.eos_token_id, list) else [hf_cfg.eos_token_id]
        pad_ends_texts = model.config.append_eos and model.pad_token_id in eos
        meta.update(weights="full", hf_prefix=prefix,
                    hf_compatible=model.config.pooling_strategy == "last" and "bias" not in head
                    and not pad_ends_texts)
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return path


def reward_model_problem(path: str | Path) -> str | None:
    """Why directory `path` is not a reward model, or None: it must hold a reward_config.json (written by
    launch/reward.py) or be a `*ForSequenceClassification` checkpoint. A causal LM would get a randomly
    initialised score head and train the policy against noise, so it is refused."""
    p = Path(path)
    if (p / CONFIG_FILE).exists():
        return None
    if not (p / "config.json").exists():
        return (f"{path} has no {CONFIG_FILE} or config.json; pass the directory written by launch/reward.py "
                f"(or RewardModelTrainer.save_model)")
    try:
        archs = json.loads((p / "config.json").read_text()).get("architectures") or []
    except (ValueError, UnicodeDecodeError) as e:
        return f"{p / 'config.json'} is not valid JSON ({e})"
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return (f"{path} is not a reward model (architectures {archs or 'unknown'}, no {CONFIG_FILE}): its score "
                f"head would be random; train one with launch/reward.py or give a *ForSequenceClassification "
                f"checkpoint")
    return None


def load_reward_model(path: str | Path, device: str | torch.device | None = None,
                      dtype: str | None = None, trainable: bool = False,
                      trust_remote_code: bool = False) -> RewardModel:
    """A saved reward model (or any `AutoModelForSequenceClassification` directory, read with
    `last` pooling) ready to score: `load_reward_model(p).score(texts) -> (B,)`. Frozen and in eval
    mode unless `trainable`.

    `trust_remote_code` is the caller's alone (the user's recipe or command line): a
    `trust_remote_code` in the directory's reward_config.json is ignored with a warning, so a
    downloaded directory cannot make this process import its own model code."""
    from rl.models import load_tokenizer
    from rl.tiny import resolve_model_path

    p = Path(resolve_model_path(str(path)))
    meta_path = p / CONFIG_FILE
    if not meta_path.exists():
        problem = reward_model_problem(p)
        # a trainable critic (PPO's value_model=critic) may start from any backbone: its head is trained
        if problem and not (trainable and (p / "config.json").exists()):
            raise FileNotFoundError(problem) if not (p / "config.json").exists() else ValueError(problem)
        cfg = RewardModelConfig(model_name=str(p), use_lora=False, dropout_prob=0.0, pooling_strategy="last",
                                dtype=dtype or "auto", trust_remote_code=trust_remote_code)
        model = RewardModel(cfg)
    else:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path} is not a {FORMAT} file")
        saved = dict(meta["config"])
        if saved.pop("trust_remote_code", False) and not trust_remote_code:
            logger.warning("%s asks for trust_remote_code; ignored (only your own config can enable it)", meta_path)
        cfg = RewardModelConfig(**saved, trust_remote_code=trust_remote_code)
        if dtype is not None:
            cfg = dataclasses.replace(cfg, dtype=dtype)
        if meta["weights"] == "full":
            cfg = dataclasses.replace(cfg, model_name=str(p))  # the directory holds the whole backbone
        kind = meta["kind"]
        if kind == "MultiObjectiveRewardModel":
            model = MultiObjectiveRewardModel(cfg, meta["num_objectives"], meta["objective_weights"])
        elif kind == "PairwiseRewardModel":
            model = PairwiseRewardModel(cfg)
        elif kind == "RewardModel":
            model = RewardModel(cfg)
        else:
            raise ValueError(f"{meta_path}: unknown reward model kind {kind!r}")
        model.load_weights(p)
    tok_dir = p if (p / "tokenizer_config.json").exists() else cfg.model_name
    model.tokenizer = load_tokenizer(str(tok_dir), cfg.trust_remote_code)
    if device is not None and not cfg.quantization:
        model.to(device)
    if not trainable:
        model.eval()
        for q in model.parameters():
            q.requires_grad_(False)
    return model


# ==================================================================================================
# Trainer
# ==================================================================================================

@dataclass
class _Split:
    chosen: list[list[int]]
    rejected: list[list[int]]
    margin: list[float] | None

    def __len__(self):
        return len(self.chosen)

    def take(self, idx: Sequence[int]) -> "_Split":
        return _Split([self.chosen[i] for i in idx], [self.rejected[i] for i in idx],
                      [self.margin[i] for i in idx] if self.margin is not None else None)


def _bt_custom_loss(model, inputs, outputs, n_pairs: int, margin=None, center_rewards_coefficient=None):
    """forward_backward_custom loss: rows [0, n) are chosen, [n, 2n) rejected."""
    r = outputs["rewards"][:, 0]
    chosen, rejected = r[:n_pairs], r[n_pairs:]
    if margin is not None:
        margin = margin.to(r.device, r.dtype)
    loss, m = bradley_terry_loss(chosen, rejected, margin, center_rewards_coefficient)
    rd = r.detach()
    m.update({"rewards/chosen": chosen.detach().mean(), "rewards/rejected": rejected.detach().mean(),
              "min_reward": rd.min(), "max_reward": rd.max(), "_sum": rd.sum(), "_sumsq": (rd ** 2).sum(),
              "_n": float(rd.numel()), "_tokens": inputs["attention_mask"].sum()})
    return loss, m


class RewardModelTrainer(Trainer):
    """Trains a `RewardModel` on preference pairs with the Bradley-Terry loss.

    Every optimizer step is `gradient_accumulation_steps` micro-batches of `batch_size` pairs per
    process, each pair's chosen and rejected texts in one forward, through the
    `ForwardBackwardPipeline` (single process, DDP or DeepSpeed ZeRO alike)."""

    def __init__(self, model: RewardModel, tokenizer=None, config: RewardModelConfig | None = None,
                 device: str | None = None, accelerator=None, output_dir: str | Path = "runs/reward"):
        from rl.forward_backward import build_accelerator

        self.cfg = self.config = config or model.config
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else model.get_tokenizer()
        model.tokenizer = self.tokenizer
        self.device = device
        self.accelerator = accelerator or build_accelerator(
            self.config.gradient_accumulation_steps, device, max_grad_norm=self.config.max_grad_norm)
        self.output_dir = Path(output_dir)
        self.pipeline = None
        self.global_step = 0
        self.history: list[dict] = []
        self.eval_split: _Split | None = None

    # ------------------------------------------------------------------ data
    def _encode(self, chosen, rejected, prompts=None, margins=None) -> _Split:
        chosen, rejected = list(chosen), list(rejected)
        if len(chosen) != len(rejected):
            raise ValueError(f"chosen_texts has {len(chosen)} texts but rejected_texts has {len(rejected)}")
        if prompts is not None:
            prompts = list(prompts)
            if len(prompts) != len(chosen):
                raise ValueError(f"prompts has {len(prompts)} entries but there are {len(chosen)} pairs")
            chosen = [p + c for p, c in zip(prompts, chosen)]
            rejected = [p + r for p, r in zip(prompts, rejected)]
        if margins is not None:
            margins = [float(m) for m in margins]
            if len(margins) != len(chosen):
                raise ValueError(f"margins has {len(margins)} entries but there are {len(chosen)} pairs")
        enc = self.model.encode
        return _Split(enc(chosen), enc(rejected), margins)

    def _micro_batches(self, n: int, batch_size: int, epoch: int) -> list[list[int]]:
        """This process's micro-batches of one epoch: a seeded shuffle, cut into global batches of
        batch_size * processes, padded cyclically so that every process runs the same number of
        whole optimizer steps (ZeRO-3 needs every rank in every forward)."""
        acc = self.accelerator
        P, rank, N = acc.num_processes, acc.process_index, self.config.gradient_accumulation_steps
        g = torch.Generator().manual_seed(self.config.seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
        per_step = batch_size * P * N
        steps = max(1, math.ceil(n / per_step))
        order = (order * math.ceil(steps * per_step / n))[:steps * per_step]
        batches = []
        for s in range(steps * N):
            glob = order[s * batch_size * P:(s + 1) * batch_size * P]
            batches.append(glob[rank * batch_size:(rank + 1) * batch_size])
        return batches

    def _batch(self, split: _Split, idx: Sequence[int]):
        part = split.take(idx)
        ids, mask = pad_batch(part.chosen + part.rejected, self.model.pad_token_id,
                              side=getattr(self.tokenizer, "padding_side", "right"))
        margin = torch.tensor(part.margin, dtype=torch.float32) if part.margin is not None else None
        return ids, mask, margin

    # ------------------------------------------------------------------ setup
    def _setup(self, total_steps: int, batch_size: int) -> None:
        from rl.forward_backward import ForwardBackwardPipeline, _inner
        from rl.models import build_optimizer, build_scheduler

        cfg = self.config
        warmup = (int(round(cfg.warmup_ratio * total_steps)) if cfg.warmup_ratio is not None
                  else min(cfg.warmup_steps, max(0, total_steps - 1)))
        if self.pipeline is None:
            self._fill_deepspeed_sizes()
            optimizer = build_optimizer(self.model, cfg.learning_rate, cfg.weight_decay)
            scheduler = build_scheduler(optimizer, cfg.lr_scheduler, total_steps, warmup_steps=warmup)
            self.pipeline = ForwardBackwardPipeline(
                self.model, accelerator=self.accelerator, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                optimizer=optimizer, scheduler=scheduler, micro_batch_size=2 * batch_size,
                checkpoint_dir=self.output_dir / "checkpoints")
        else:  # a second train_on_preferences call: fresh schedule on the same optimizer
            inner = _inner(self.pipeline.optimizer)
            for g in inner.param_groups:
                g["lr"] = g.get("initial_lr", cfg.learning_rate)
            self.pipeline.scheduler = build_scheduler(inner, cfg.lr_scheduler, total_steps, warmup_steps=warmup)

    def _fill_deepspeed_sizes(self) -> None:
        """Fill ZeRO's hidden-size based "auto" buckets as accelerate would: it reads
        `model.config.hidden_size`, which our wrapper's config (a RewardModelConfig) lacks."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            return
        h = self.model.hf_config.get_text_config().hidden_size
        zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
        for key, value in (("reduce_bucket_size", h * h), ("stage3_prefetch_bucket_size", int(0.9 * h * h)),
                           ("stage3_param_persistence_threshold", 10 * h)):
            if zero.get(key) == "auto":
                zero[key] = value

    # ------------------------------------------------------------------ training
    def train_on_preferences(self, chosen_texts: Sequence[str], rejected_texts: Sequence[str],
                             prompts: Sequence[str] | None = None, num_epochs: int = 1, batch_size: int = 8,
                             eval_fraction: float = 0.0, margins: Sequence[float] | None = None,
                             eval_data: dict | None = None, log_fn: Callable[[int, dict], None] | None = None,
                             tracker=None) -> dict[str, float]:
        """Train on pairs (optionally with `prompts` prepended and per-pair `margins`).

        `eval_fraction` holds out that share of the pairs (seeded) for `evaluate()`; `eval_data`
        (`{"chosen": [...], "rejected": [...], "prompts": [...]}`) gives a separate eval set instead.
        `log_fn(step, metrics)` is called after every optimizer step (and with eval metrics), or give a
        `rl.tracking.Tracker` as `tracker`. Checkpoints, resume and signals follow the run core
        (rl.trainers.base): `config.save_every`, `config.resume`, `config.save_total_limit`.
        Returns the last step's metrics plus the final evaluation."""
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        data = self._encode(chosen_texts, rejected_texts, prompts, margins)
        if len(data) == 0:
            raise ValueError("no preference pairs to train on")
        if eval_data is not None:
            self.eval_split = self._encode(eval_data["chosen"], eval_data["rejected"], eval_data.get("prompts"),
                                           eval_data.get("margins"))
            train = data
        elif eval_fraction > 0:
            g = torch.Generator().manual_seed(self.config.seed)
            perm = torch.randperm(len(data), generator=g).tolist()
            n_eval = max(1, int(round(eval_fraction * len(data))))
            if n_eval >= len(data):
                raise ValueError(f"eval_fraction={eval_fraction} leaves no training pairs out of {len(data)}")
            self.eval_split, train = data.take(perm[:n_eval]), data.take(perm[n_eval:])
        else:
            train = data
        N = self.config.gradient_accumulation_steps
        # the optimizer steps of this call, each N micro-batches of this process's pairs
        steps = []
        for e in range(num_epochs):
            batches = self._micro_batches(len(train), batch_size, e)
            steps += [batches[s:s + N] for s in range(0, len(batches) - N + 1, N)]
        if self.config.max_steps is not None:
            steps = steps[:self.config.max_steps]
        self._setup(len(steps), batch_size)
        self.model.train()
        self._train, self._steps, self._done, self._bs = train, steps, 0, batch_size
        tracker = tracker or CallbackTracker(log_fn)
        per_step = batch_size * self.accelerator.num_processes * N
        if len(train) % per_step:
            tracker.write(f"warning: {len(train)} training pairs do not fill whole global batches of {per_step} "
                          f"(batch_size {batch_size} x gradient_accumulation_steps {N} x "
                          f"{self.accelerator.num_processes} processes): the last step of each epoch is "
                          f"completed with pairs from the epoch's start")
        rows = self.fit(len(steps), tracker)
        self.history += rows
        last = next((r for r in reversed(rows) if "loss" in r), {})
        return {k: v for k, v in last.items() if k != "step"}

    # ------------------------------------------------------------------ the lifecycle's hooks
    @property
    def current_step(self) -> int:
        return self._done

    @property
    def run_dir(self) -> Path:
        return self.output_dir

    def train_step(self) -> list[dict]:
        pipe, cfg = self.pipeline, self.config
        futures = []
        for idx in self._steps[self._done]:
            ids, mask, margin = self._batch(self._train, idx)
            futures.append(pipe.forward_backward_custom(
                _bt_custom_loss, ids, mask, n_pairs=len(idx), margin=margin,
                center_rewards_coefficient=cfg.center_rewards_coefficient))
        step = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        metrics = self._step_metrics([f.result() for f in futures], step)
        self._done += 1
        self.global_step += 1
        return [{"step": self._done, **metrics}]

    def evaluate_now(self) -> dict | None:
        return self.evaluate(batch_size=self._bs) if self.eval_split is not None else None

    def checkpoint_extra(self) -> dict:
        return {"done": self._done, "global_step": self.global_step}

    def restore(self, extra: dict) -> None:
        self._done, self.global_step = int(extra["done"]), int(extra["global_step"])

    def _step_metrics(self, results, step) -> dict[str, float]:
        """Average micro-batch metrics over the step and over processes (std from pooled sums)."""
        keys = ["loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected"]
        vals = [sum((r.loss if k == "loss" else r.metrics[k]) for r in results) / len(results) for k in keys]
        sums = [sum(r.metrics[k] for r in results) for k in ("_sum", "_sumsq", "_n", "_tokens")]
        mn = min(r.metrics["min_reward"] for r in results)
        mx = max(r.metrics["max_reward"] for r in results)
        acc = self.accelerator
        t = torch.tensor(vals + sums, dtype=torch.float64, device=acc.device)
        ext = torch.tensor([-mn, mx], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            t = acc.reduce(t, reduction="sum")
            t[:len(keys)] /= acc.num_processes
            ext = acc.gather(ext).view(-1, 2).max(0).values
        out = dict(zip(keys, t[:len(keys)].tolist()))
        s, sq, n, tokens = t[len(keys):].tolist()
        mean = s / n
        out.update(mean_reward=mean, std_reward=math.sqrt(max(0.0, sq / n - mean * mean)),
                   min_reward=-float(ext[0]), max_reward=float(ext[1]), num_tokens=tokens,
                   learning_rate=step.learning_rate, grad_norm=step.grad_norm)
        return out

    @torch.no_grad()
    def evaluate(self, chosen_texts: Sequence[str] | None = None, rejected_texts: Sequence[str] | None = None,
                 prompts: Sequence[str] | None = None, margins: Sequence[float] | None = None,
                 batch_size: int = 8) -> dict[str, float]:
        """Loss, accuracy, margin and reward statistics (`eval/...`) on the given pairs or the
        held-out split. Every process scores every pair (identical results, no gather needed)."""
        split = self._encode(chosen_texts, rejected_texts, prompts, margins) if chosen_texts is not None \
            else self.eval_split
        if split is None or len(split) == 0:
            raise ValueError("nothing to evaluate: pass chosen_texts/rejected_texts or train with eval_fraction > 0")
        model = self.pipeline.model if self.pipeline is not None else self.model
        was_training = self.model.training
        model.eval()
        rc, rr = [], []
        for s in range(0, len(split), batch_size):
            idx = list(range(s, min(s + batch_size, len(split))))
            ids, mask, _ = self._batch(split, idx)
            dev = self.accelerator.device
            r = model(input_ids=ids.to(dev), attention_mask=mask.to(dev))["rewards"][:, 0].float().cpu()
            rc.append(r[:len(idx)])
            rr.append(r[len(idx):])
        model.train(was_training)
        rc, rr = torch.cat(rc), torch.cat(rr)
        margin = torch.tensor(split.margin) if split.margin is not None else None
        loss, m = bradley_terry_loss(rc, rr, margin, self.config.center_rewards_coefficient)
        allr = torch.cat([rc, rr])
        return {"eval/loss": float(loss), "eval/accuracy": float(m["accuracy"]), "eval/margin": float(m["margin"]),
                "eval/rewards/chosen": float(rc.mean()), "eval/rewards/rejected": float(rr.mean()),
                "eval/mean_reward": float(allr.mean()), "eval/std_reward": float(allr.std(unbiased=False))}

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, path: str | Path) -> Path:
        """Save the (trained) model to directory `path`; call it on every process (ZeRO-3 gathers
        the weights), only the main process writes."""
        if self.pipeline is not None:
            acc = self.accelerator
            sd = acc.get_state_dict(self.pipeline.model)
            if acc.is_main_process:
                save_reward_model(acc.unwrap_model(self.pipeline.model), path, sd)
            acc.wait_for_everyone()
            return Path(path)
        return save_reward_model(self.model, path)

    def load_model(self, path: str | Path) -> None:
        """Load weights saved by `save_model` into this trainer's model (before or after training)."""
        self.model.load_weights(path)


# ==================================================================================================
# Preference data
# ==================================================================================================

@dataclass
class PreferencePairs:
    prompts: list[str] | None
    chosen: list[str]
    rejected: list[str]
    margins: list[float] | None

    def __len__(self):
        return len(self.chosen)


def load_preference_pairs(path: str | Path, prompt_column: str = "prompt", chosen_column: str = "chosen",
                          rejected_column: str = "rejected", margin_column: str | None = None,
                          max_examples: int | None = None, max_report: int = 5, name: str | None = None,
                          split: str | None = None) -> PreferencePairs:
    """`{"prompt", "chosen", "rejected"[, margin]}` rows of a JSONL/JSON/CSV/Parquet file, validated.

    The prompt column is optional for the whole file (absent everywhere: no prompts). Every bad row
    (missing or non-string field, empty text, chosen identical to rejected, non-numeric margin) is
    collected and reported together with its line number in one DataError. `name`/`split`: the
    config and split of a dataset folder or Hub id (see rl.data.read_records)."""
    from rl.data import DataError, read_records, where

    rows = read_records(path, name=name, split=split)
    if max_examples:
        rows = rows[:max_examples]
    if not rows:
        raise DataError(f"{path}: no examples (the file is empty)")
    has_prompt = any(prompt_column in r for r in rows)
    text_cols = ([prompt_column] if has_prompt else []) + [chosen_column, rejected_column]
    problems: list[str] = []
    prompts, chosen, rejected, margins = [], [], [], []
    for row in rows:
        here = where(path, row)
        bad = []
        for col in text_cols:
            v = row.get(col)
            if v is None:
                bad.append(f"missing field '{col}'")
            elif not isinstance(v, str):
                bad.append(f"field '{col}' must be a string, got {type(v).__name__}")
            elif col != prompt_column and not v.strip():
                bad.append(f"field '{col}' is empty")
        if not bad and row[chosen_column] == row[rejected_column]:
            bad.append(f"'{chosen_column}' and '{rejected_column}' are identical (no preference to learn)")
        m = 0.0
        if margin_column is not None:
            try:
                m = float(row[margin_column])
                if not math.isfinite(m):
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                bad.append(f"field '{margin_column}' must be a finite number, got {row.get(margin_column)!r}")
        if bad:
            problems.append(f"{here}: {'; '.join(bad)}")
            continue
        if has_prompt:
            prompts.append(row[prompt_column])
        chosen.append(row[chosen_column])
        rejected.append(row[rejected_column])
        margins.append(m)
    if problems:
        more = f" (and {len(problems) - max_report} more bad rows)" if len(problems) > max_report else ""
        raise DataError(f"{len(problems)} bad preference rows; fix or remove them: "
                        + " | ".join(problems[:max_report]) + more)
    return PreferencePairs(prompts if has_prompt else None, chosen, rejected,
                           margins if margin_column is not None else None)


# ==================================================================================================
# Recipe schema (launch/reward.py)
# ==================================================================================================

@dataclass
class RewardTrainConfig(TrainConfig):
    """Recipe schema of launch/reward.py: the shared TrainConfig plus the reward-model fields.

    LoRA is the shared `lora:` section (lora.enabled, lora.rank, ...). The reference CLI's column
    flags are accepted: --prompt-text-column, --text-column (the chosen answer) and
    --rejected-text-column set data.prompt_column, data.chosen_column and data.rejected_column."""

    pooling_strategy: Literal["last", "mean", "cls"] = opt("last", "hidden state read by the head: last real token, masked mean, first token")
    dropout_prob: float = opt(0.0, "dropout on the pooled state during training")
    temperature: float = opt(1.0, "rewards are divided by this")
    load_in_4bit: bool = opt(False, "NF4 backbone via bitsandbytes (QLoRA); needs lora.enabled=true")
    load_in_8bit: bool = opt(False, "int8 backbone via bitsandbytes; needs lora.enabled=true")
    warmup_steps: int | None = opt(None, "linear warmup steps; null: use warmup_ratio")
    center_rewards_coefficient: float | None = opt(None, "weight of mean((r_chosen + r_rejected)^2), keeps rewards centred (TRL name)")
    margin_column: str | None = opt(None, "optional numeric column: required reward gap per pair")
    append_eos: bool = opt(True, "end every text with EOS (TRL's format)")
    prompt_text_column: str | None = opt(None, "reference CLI name for data.prompt_column")
    text_column: str | None = opt(None, "reference CLI name for data.chosen_column (the preferred text)")
    rejected_text_column: str | None = opt(None, "reference CLI name for data.rejected_column")

    def __post_init__(self):
        super().__post_init__()
        defaults = {"prompt_column": "prompt", "chosen_column": "chosen", "rejected_column": "rejected"}
        for alias, target in (("prompt_text_column", "prompt_column"), ("text_column", "chosen_column"),
                              ("rejected_text_column", "rejected_column")):
            value = getattr(self, alias)
            if value is None:
                continue
            current = getattr(self.data, target)
            if current != defaults[target] and current != value:
                raise ConfigError(f"{alias}={value!r} and data.{target}={current!r} disagree; set only one")
            setattr(self.data, target, value)
        if (self.load_in_4bit or self.load_in_8bit) and not self.lora.enabled:
            raise ConfigError("load_in_4bit/load_in_8bit train LoRA adapters on a quantized backbone: "
                              "set lora.enabled=true")
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_4bit and load_in_8bit are both true; choose one")
        if not self.temperature > 0:
            raise ConfigError(f"key 'temperature' must be > 0, got {self.temperature}")

    def model_config(self) -> RewardModelConfig:
        """The library-level RewardModelConfig this recipe describes."""
        return RewardModelConfig(
            model_name=self.model_name, num_labels=1, pooling_strategy=self.pooling_strategy,
            dropout_prob=self.dropout_prob, temperature=self.temperature, use_lora=self.lora.enabled,
            lora_rank=self.lora.rank, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
            lora_target_modules=self.lora.target_modules, load_in_4bit=self.load_in_4bit,
            load_in_8bit=self.load_in_8bit, learning_rate=self.learning_rate, weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps if self.warmup_steps is not None else 0,
            warmup_ratio=None if self.warmup_steps is not None else self.warmup_ratio,
            lr_scheduler=self.lr_scheduler, gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_grad_norm=self.max_grad_norm, max_length=self.max_length, max_steps=self.max_steps,
            center_rewards_coefficient=self.center_rewards_coefficient, append_eos=self.append_eos,
            dtype=self.dtype, gradient_checkpointing=self.gradient_checkpointing,
            trust_remote_code=self.trust_remote_code, seed=self.seed, eval_every=self.eval_every,
            log_every=self.log_every, save_every=self.save_every, save_total_limit=self.save_total_limit,
            resume=self.resume)
