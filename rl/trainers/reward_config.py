"""Recipe schema of launch/reward.py (the shared TrainConfig plus the reward-model fields) and the
library-level RewardModelConfig it describes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rl.config.fields import opt
from rl.config.schema import TrainConfig
from rl.errors import ConfigError
from rl.models.reward import RewardModelConfig


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
    packing: bool = opt(False, "padding-free micro-batches: each micro-batch's chosen and rejected texts packed "
                        "into rows no longer than its longest, with per-text position_ids (rl.engine.packing); "
                        "each text pooled on its own; same loss, no compute on padding")
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
            packing=self.packing,
            dtype=self.dtype, gradient_checkpointing=self.gradient_checkpointing,
            trust_remote_code=self.trust_remote_code, seed=self.seed, eval_every=self.eval_every,
            log_every=self.log_every, save_every=self.save_every, save_total_limit=self.save_total_limit,
            resume=self.resume)
