"""Reward models: standard (Bradley-Terry), pairwise and multi-objective, full, LoRA or 4-bit QLoRA.

A `RewardModel` is a transformer backbone (the base model of `AutoModelForSequenceClassification`)
plus a linear head on one pooled hidden state, divided by `temperature`. Deviations from the
reference implementation, all deliberate (see shared/reference/README.md, "traps"):
* `last` pooling picks the last *real* token from the attention mask, so left and right padding give
  the same reward; position ids are derived from the mask for the same reason. `cls` is the first
  real token, `mean` a masked mean.
* LoRA targets every linear layer by default (GPT-2's Conv1D included), not only q_proj/v_proj.
* Checkpoints are safetensors plus JSON, never pickles (rl.models.reward_format). A full fine-tune is written in
  the layout of `AutoModelForSequenceClassification` (with `temperature` folded into `score.weight`),
  so it loads without this package; with `pooling_strategy="last"` that model gives the same rewards.
* Texts are `prompt + answer + eos` (TRL's format); too-long texts lose their *beginning*, so the
  answer's end, where `last` pooling reads, survives truncation.

`load_reward_model(path)` gives the frozen model with `score(texts) -> (B,)` that PPO/GRPO use.
The trainer is rl.trainers.reward.RewardModelTrainer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from rl.algos.reduce import masked_mse
from rl.data.preference import encode_texts, pad_batch, stack_pair
from rl.engine.packing import pool_packed, position_ids_from_mask
from rl.errors import ConfigError
from rl.models.limits import check_length
from rl.models.loading import (
    add_neftune,
    apply_lora,
    disable_dropout,
    enable_checkpointing,
    load_causal_lm,
    load_tokenizer,
    lora_options,
    quantization_options,
)
from rl.models.reward_config import RewardModelConfig
from rl.models.reward_format import (
    CONFIG_FILE,
    FORMAT,
    load_reward_weights,
    reward_model_problem,
    save_reward_model,
)
from rl.models.sources import resolve_model_path

logger = logging.getLogger(__name__)


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
        self.config = config
        self.tokenizer = tokenizer
        hf = load_causal_lm(config.model_name, dtype=config.dtype, trust_remote_code=config.trust_remote_code,
                            gradient_checkpointing=False, task="classifier", num_labels=config.num_labels,
                            revision=config.model_revision, init_kwargs=config.model_init_kwargs,
                            **quantization_options(config))
        if config.disable_dropout:
            disable_dropout(hf)
        check_length(config.max_length, hf, config.model_name)  # texts are cut to max_length, which must fit
        self.hf_config = hf.config  # written next to full fine-tunes for AutoModelForSequenceClassification
        self.hf_prefix = hf.base_model_prefix
        self.hf_config.architectures = [type(hf).__name__]
        backbone = getattr(hf, self.hf_prefix)
        add_neftune(backbone, config.neftune_noise_alpha)
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
            enable_checkpointing(backbone, config.gradient_checkpointing_kwargs)
        if config.quantization:
            from peft import (
                prepare_model_for_kbit_training,  # optional: only for a quantized backbone
            )

            # Freezes the quantized weights and upcasts norms; adapters and head stay trainable.
            backbone = prepare_model_for_kbit_training(
                backbone, use_gradient_checkpointing=config.gradient_checkpointing)
        if config.lora.enabled:
            backbone = apply_lora(backbone, **lora_options(config.lora), task_type=None)
        self.backbone = backbone
        self.dropout = nn.Dropout(config.dropout_prob)
        self.head = head
        self.pad_token_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    # ------------------------------------------------------------------ forward
    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None, sequence_index: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H) pooled hidden state of the last layer.

        Packed rows (`rl.engine.packing.pack_sequences`, no attention_mask): `position_ids` and
        `sequence_index` (R, W) go with them; the backbone then gets no mask and no cache (so it builds
        the block-diagonal mask from the position ids) and the result is (S, H), one vector per sequence
        in index order: the same vectors as the padded batch of those S sequences."""
        if sequence_index is not None:
            out = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            return pool_packed(hidden, sequence_index, int(sequence_index.max()) + 1, self.config.pooling_strategy)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return pool_hidden(hidden, attention_mask, self.config.pooling_strategy)

    def rewards(self, input_ids, attention_mask=None, position_ids=None, sequence_index=None) -> torch.Tensor:
        """(B, num_labels) rewards divided by the temperature ((S, num_labels) for packed rows, see `pooled`)."""
        h = self.dropout(self.pooled(input_ids, attention_mask, position_ids, sequence_index))
        return self.head(h.to(self.head.weight.dtype)).float() / self.config.reward_temperature

    def forward(self, input_ids, attention_mask=None, position_ids=None, sequence_index=None, **kwargs) -> RewardOutput:
        r = self.rewards(input_ids, attention_mask, position_ids, sequence_index)
        return RewardOutput(rewards=r, logits=r)

    # ------------------------------------------------------------------ scoring texts
    def get_tokenizer(self):
        if self.tokenizer is None:
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
                "config": self.config.model_fields()}

    def save(self, path: str | Path, state_dict: dict | None = None) -> Path:
        """Write this model to directory `path` (see `save_reward_model`)."""
        return save_reward_model(self, path, state_dict)

    def load_weights(self, path: str | Path) -> None:
        """Load head and adapters (LoRA) or all weights (full) saved by `save` into this model."""
        load_reward_weights(self, path)

    # the engine's checkpoint hooks (rl.engine.pipeline): `checkpoint-N/` holds what `save` writes, so it
    # loads as the final output does (AutoModelForSequenceClassification, PeftModel, load_reward_model)
    def save_checkpoint_weights(self, state_dict: dict, path: Path) -> None:
        save_reward_model(self, path, state_dict)

    def load_checkpoint_weights(self, path: Path) -> None:
        load_reward_weights(self, path)


class PairwiseRewardModel(RewardModel):
    """Bradley-Terry comparison of two texts: logit P(A preferred over B) = r(A) - r(B)."""

    def forward_pair(self, input_ids_a, attention_mask_a, input_ids_b, attention_mask_b) -> torch.Tensor:
        """(B,) logit that A is preferred; A and B go through the backbone as one batch of 2B rows,
        so any B >= 1 works and both sides see the same dropout mode."""
        ids, mask = stack_pair(input_ids_a, attention_mask_a, input_ids_b, attention_mask_b, self.pad_token_id)
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

    def forward(self, input_ids, attention_mask=None, return_all_objectives: bool = True, position_ids=None,
                sequence_index=None, **kwargs):
        """`rewards` (B, K) and `combined_reward` (B, 1) = rewards @ weights; without
        `return_all_objectives` only the combined reward tensor (B, 1). Packed rows as in `RewardModel.pooled`."""
        r = self.rewards(input_ids, attention_mask, position_ids, sequence_index)
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


def load_reward_model(path: str | Path, device: str | torch.device | None = None,
                      dtype: str | None = None, trainable: bool = False,
                      trust_remote_code: bool = False) -> RewardModel:
    """A saved reward model (or any `AutoModelForSequenceClassification` directory, read with
    `last` pooling) ready to score: `load_reward_model(p).score(texts) -> (B,)`. Frozen and in eval
    mode unless `trainable`.

    `trust_remote_code` is the caller's alone (the user's recipe or command line): a
    `trust_remote_code` in the directory's reward_config.json is ignored with a warning, so a
    downloaded directory cannot make this process import its own model code."""
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
        overrides = {"trust_remote_code": trust_remote_code, **({"dtype": dtype} if dtype is not None else {})}
        if meta["weights"] == "full":
            overrides["model_name"] = str(p)  # the directory holds the whole backbone
        cfg = RewardModelConfig.from_saved(saved, **overrides)
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
