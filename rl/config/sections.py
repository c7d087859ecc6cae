"""The sections of every trainer's config: `lora` (LoraSection) and `data` (DataSection: files, Hub datasets,
streaming, mixtures, eval splits, column names), with `mixture_problem` (the first mistake in a data.mixture).
TRL's flat keys reach them through the alias table (rl.config.vocabulary: `lora_r` -> `lora.rank`,
`dataset_name` -> `data.path`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rl.config.fields import opt
from rl.errors import ConfigError


@dataclasses.dataclass
class LoraSection:
    """LoRA adapters (peft's LoraConfig); TRL's ModelConfig keys are aliases of these (use_peft, lora_r, lora_alpha,
    lora_dropout, lora_target_modules, lora_modules_to_save, lora_target_parameters, use_rslora, use_dora)."""

    enabled: bool = opt(False, "train LoRA adapters instead of all weights")
    rank: int = opt(16, "LoRA rank r")
    alpha: int = opt(32, "LoRA scaling alpha (effective scale alpha / r)")
    dropout: float = opt(0.05, "dropout on the LoRA input")
    target_modules: str | list[str] | None = opt(
        "all-linear", "modules to adapt: 'all-linear', a list or a comma-separated list of module names, or null "
        "(peft's default for the architecture, as TRL's lora_target_modules: null)")
    modules_to_save: list[str] | None = opt(None, "modules trained in full and saved beside the adapter (e.g. "
                                            "[lm_head, embed_tokens]; TRL's lora_modules_to_save)")
    target_parameters: list[str] | None = opt(None, "parameters (not modules) to adapt, e.g. MoE experts' "
                                              "(peft's target_parameters)")
    use_rslora: bool = opt(False, "rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r")
    use_dora: bool = opt(False, "DoRA: weight-decomposed LoRA (magnitude and direction)")

    def __post_init__(self):
        if self.rank < 1:
            raise ConfigError(f"key 'lora.rank' must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"key 'lora.dropout' must be in [0, 1), got {self.dropout}")


@dataclasses.dataclass
class DataSection:
    path: str | None = opt(None, "training data: a .jsonl/.json/.csv/.parquet file, a saved datasets dir, a "
                           "dataset folder laid out as on the Hub, or a Hub dataset id (trl-lib/Capybara)")
    name: str | None = opt(None, "config (subset) of a dataset folder or Hub dataset, as load_dataset's name")
    split: str = opt("train", "split of data.path to train on (dataset folders, Hub ids, saved DatasetDicts)")
    eval_path: str | None = opt(None, "optional evaluation data in the same forms (the same Hub id is fine)")
    eval_split: str = opt("test", "split of eval_path to evaluate on (dataset folders, Hub ids, DatasetDicts)")
    eval_fraction: float = opt(0.0, "fraction of the training data held out for evaluation when no eval_path")
    text_column: str = opt("text", "column with the full text (SFT) or the prompt text (PPO/GRPO)")
    prompt_column: str = opt("prompt", "column with the prompt")
    completion_column: str = opt("completion", "column with the completion (SFT prompt/completion data)")
    chosen_column: str = opt("chosen", "column with the preferred answer")
    rejected_column: str = opt("rejected", "column with the rejected answer")
    label_column: str = opt("label", "column with KTO's label: true (desirable completion) or false")
    messages_column: str = opt("messages", "column with chat messages, rendered with the chat template")
    strict: bool = opt(False, "fail on examples longer than max_length instead of truncating them")
    max_examples: int | None = opt(None, "use only the first N examples (smoke tests); the number of rows "
                                   "data.streaming fetches, and the total of data.mixture")
    streaming: bool = opt(False, "stream a Hub id or dataset folder (load_dataset streaming=True) and fetch only "
                          "its first data.max_examples rows, so a huge dataset is not downloaded whole "
                          "(needs data.max_examples; applies to data.path, data.eval_path and mixture sources)")
    mixture: list[dict[str, Any]] | None = opt(
        None, "instead of data.path, several sources mixed by weight: [{path: a.jsonl, weight: 0.7}, {path: "
        "org/ds, name: x, split: train, weight: 0.3}] (name/split optional, as data.name/data.split). Exact "
        "proportions, each source's first rows, the order shuffled by seed; data.max_examples rows in all, "
        "or without it as many as the mixture holds until one source runs out at its weight")

    def __post_init__(self):
        if self.streaming and not self.max_examples:
            raise ConfigError("key 'data.streaming' fetches only the first data.max_examples rows; set "
                              "data.max_examples (e.g. --data.max_examples 10000) or drop data.streaming")
        if self.mixture is not None:
            problem = mixture_problem(self.mixture, self.path)
            if problem:
                raise ConfigError(problem)


MIXTURE_KEYS = ("path", "weight", "name", "split")


def mixture_problem(mixture: list[dict], path: str | None) -> str | None:
    """The first mistake in a data.mixture (with data.path beside it), as a one-line message, or None."""
    if path is not None:
        return ("keys 'data.path' and 'data.mixture' are alternatives: drop data.path, or put it in the "
                "mixture as {path: ..., weight: ...}")
    if not mixture:
        return "key 'data.mixture' is empty: list at least one {path: ..., weight: ...} (or use data.path)"
    for i, entry in enumerate(mixture):
        key = f"data.mixture[{i}]"
        unknown = sorted(set(entry) - set(MIXTURE_KEYS))
        if unknown:
            return f"key '{key}' has unknown key '{unknown[0]}' (allowed: {', '.join(MIXTURE_KEYS)})"
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            return f"key '{key}.path' must be a data file, dataset folder or hub id, got {entry.get('path')!r}"
        w = entry.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            return f"key '{key}.weight' must be a positive number (the source's share of the rows), got {w!r}"
        for opt_key in ("name", "split"):
            if entry.get(opt_key) is not None and not isinstance(entry[opt_key], str):
                return f"key '{key}.{opt_key}' must be a string, got {entry[opt_key]!r}"
    return None
