"""Recipe schema of launch/reward.py: the reward model's one config (rl.models.reward_config) with the
house defaults and the recipe-only keys."""

from __future__ import annotations

from dataclasses import dataclass

from rl.config.fields import REQUIRED, opt, section
from rl.config.schema import LoraSection
from rl.errors import ConfigError
from rl.models.reward_config import RewardModelConfig


@dataclass
class RewardTrainConfig(RewardModelConfig):
    """Recipe schema of launch/reward.py: `RewardModelConfig` (the model and its run, the object the
    trainer and the model read; there is no second config to copy into) with the defaults every recipe
    schema has (TrainConfig's: LoRA off, learning rate 1e-5, warmup by warmup_ratio, no dropout) and the
    keys only a recipe has (margin_column, the reference CLI's column names).

    LoRA is the shared `lora:` section (lora.enabled, lora.rank, ...). `temperature` is accepted for
    reward_temperature. The reference CLI's column flags are accepted: --prompt-text-column, --text-column
    (the chosen answer) and --rejected-text-column set data.prompt_column, data.chosen_column and
    data.rejected_column."""

    # the house defaults (TrainConfig's), where RewardModelConfig has the reference's
    model_name: str = opt(REQUIRED, "HF model id or local path; 'tiny:llama' builds a tiny local model")
    learning_rate: float = opt(1e-5, "peak learning rate of AdamW")
    lora: LoraSection = section(LoraSection, "LoRA adapters")
    dropout_prob: float = opt(0.0, "dropout on the pooled state during training")
    warmup_steps: int | float | None = opt(None, "linear warmup steps (below 1: a fraction of the run); null: "
                                           "use warmup_ratio")
    # recipe-only keys
    margin_column: str | None = opt(None, "optional numeric column: required reward gap per pair")
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
        if self.num_labels != 1:
            raise ConfigError(f"key 'num_labels' must be 1 (launch/reward.py trains a scalar reward), got {self.num_labels}")
        if self.warmup_steps is not None and self.warmup_ratio:
            raise ConfigError(f"warmup_steps={self.warmup_steps} and warmup_ratio={self.warmup_ratio} both set the "
                              f"warmup; set only one")
