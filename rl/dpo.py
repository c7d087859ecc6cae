"""DPO, under the module name the reference docs use (`rl.dpo`, where `PreferenceDataset` is
imported from): a thin public facade over `rl.trainers.dpo` and `rl.data.preference`."""

from rl.data.preference import PreferenceDataset
from rl.trainers.dpo import DPOConfig, DPOTrainer

__all__ = ["DPOConfig", "DPOTrainer", "PreferenceDataset"]
