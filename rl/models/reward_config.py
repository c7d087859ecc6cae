"""The reward model's config (`RewardModelConfig`): the shared TrainConfig plus the reward-model keys,
one config for the model and its training run. The recipe schema of launch/reward.py
(rl.trainers.reward_config.RewardTrainConfig) is this class with the house defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl.config.fields import opt
from rl.config.schema import LoraSection, TrainConfig
from rl.errors import ConfigError

# The reference docs' flat LoRA names (RewardModelConfig(use_lora=..., lora_rank=...)), aliases of the `lora:`
# section's keys in the one alias table (rl.config.vocabulary.ALIASES: use_lora -> lora.enabled, ...); what a saved
# model's reward_config.json holds
REFERENCE_LORA = ("use_lora", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")


@dataclass
class RewardModelConfig(TrainConfig):
    """A reward model and its training run: the shared TrainConfig plus the reward-model keys, with the
    reference's defaults (LoRA r=8 on, dropout 0.1, learning rate 1e-4, 100 warmup steps). The recipe
    schema of launch/reward.py (rl.trainers.reward_config.RewardTrainConfig) is this class with the house
    defaults. The reference's flat names are accepted and readable: use_lora, lora_rank, lora_alpha,
    lora_dropout, lora_target_modules (the `lora` section) and temperature (reward_temperature)."""

    ALIASES = {"temperature": "reward_temperature"}  # the recipe alias too (rl.config.fields._aliases)
    # what a saved model's reward_config.json holds: the keys that rebuild the model (flat, as the reference)
    MODEL_KEYS = ("model_name", "num_labels", "pooling_strategy", "dropout_prob", "reward_temperature",
                  *REFERENCE_LORA, "load_in_4bit", "load_in_8bit", "max_length", "append_eos", "packing", "dtype",
                  "gradient_checkpointing", "trust_remote_code")

    model_name: str = opt("tiny:llama", "HF id, local path or tiny:<family>")
    output_dir: str = opt("runs/reward", "where checkpoints, metrics and the final model go")
    learning_rate: float = opt(1e-4, "peak AdamW learning rate")
    lora: LoraSection = field(default_factory=lambda: LoraSection(enabled=True, rank=8, alpha=16, dropout=0.1),
                              metadata={"help": "LoRA adapters (reference names: use_lora, lora_rank, ...)"})
    disable_dropout: bool = opt(True, "set every dropout of the trained model to 0 (TRL's default here)")
    num_labels: int = opt(1, "outputs of the head (1 for a scalar reward)")
    pooling_strategy: Literal["last", "mean", "cls"] = opt(
        "last", "hidden state read by the head: last real token, masked mean, first token")
    dropout_prob: float = opt(0.1, "dropout on the pooled state (training only)")
    reward_temperature: float = opt(1.0, "rewards are divided by this (a scale of the reward, not a sampling "
                                    "temperature; alias: temperature)")
    warmup_steps: int | float | None = opt(100, "linear warmup steps (capped at the run length); warmup_ratio > 0 wins; "
                                   "null: warmup_ratio")
    center_rewards_coefficient: float | None = opt(
        None, "weight of mean((r_chosen + r_rejected)^2), keeps rewards centred (TRL name)")
    append_eos: bool = opt(True, "end every text with EOS (TRL's format)")
    packing: bool = opt(False, "padding-free micro-batches: each micro-batch's chosen and rejected texts packed "
                        "into rows no longer than its longest, with per-text position_ids (rl.engine.packing); "
                        "each text pooled on its own; same loss, no compute on padding")

    def __post_init__(self):
        if self.warmup_ratio is None:  # the former "unset"
            self.warmup_ratio = 0.0
        super().__post_init__()
        if self.num_labels < 1:
            raise ConfigError(f"key 'num_labels' must be at least 1, got {self.num_labels}")
        if self.pooling_strategy not in ("last", "mean", "cls"):
            raise ConfigError(f"key 'pooling_strategy' must be last, mean or cls, got {self.pooling_strategy!r}")
        if not self.reward_temperature > 0:
            raise ConfigError(f"key 'reward_temperature' (alias temperature) must be > 0, got {self.reward_temperature}")
        if not 0.0 <= self.dropout_prob < 1.0:
            raise ConfigError(f"key 'dropout_prob' must be in [0, 1), got {self.dropout_prob}")
        if self.max_length < 2:
            raise ConfigError(f"key 'max_length' must be at least 2, got {self.max_length}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"key 'warmup_steps' must be >= 0 or null, got {self.warmup_steps}")

    @property
    def quantization(self) -> str | None:
        return "4bit" if self.load_in_4bit else "8bit" if self.load_in_8bit else None

    @property
    def temperature(self) -> float:
        """The former name of `reward_temperature`."""
        return self.reward_temperature

    def model_fields(self) -> dict:
        """What rebuilds the model (MODEL_KEYS), as reward_config.json stores it."""
        return {k: getattr(self, k) for k in self.MODEL_KEYS}

    @classmethod
    def from_saved(cls, saved: dict, **overrides) -> "RewardModelConfig":
        """The config of a saved reward_config.json: its model keys (the former name `temperature`
        included); the training keys that former versions also wrote are ignored."""
        keep = set(cls.MODEL_KEYS) | set(cls.ALIASES)
        return cls(**{**{k: v for k, v in saved.items() if k in keep}, **overrides})

