"""Loading models and building optimizers: dtype, LoRA, 4-bit, gradient checkpointing, frozen copies.

Every trainer loads through here so that `tiny:<family>` names, `trust_remote_code` (off unless the
user asks), attention kernels and LoRA targets behave the same everywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from rl.config import ConfigError
from rl.tiny import _without_zero3_init, resolve_model_path


def resolve_dtype(name: str | None) -> torch.dtype:
    """'auto' -> bfloat16 on a CUDA GPU that supports it, else float32 (CPU bf16 is slow here)."""
    if name in (None, "auto"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[name]


def not_loadable(name: str, what: str, error: Exception) -> ConfigError:
    """One line for a model/tokenizer the loader could not find or read (a hub id offline, a typo)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return ConfigError(f"model {name!r}: cannot load its {what} ({first}); check the name, or download it "
                       f"first (hf download {name}) when this machine is offline")


def load_tokenizer(name: str, trust_remote_code: bool = False, padding_side: str = "right"):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
    except OSError as e:  # transformers' "not a valid model identifier / no such file" family
        raise not_loadable(name, "tokenizer", e) from None
    if tok.pad_token is None:
        # Many causal LMs ship without a pad token; reuse EOS (masked out everywhere we pad).
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def load_causal_lm(name: str, dtype: str | torch.dtype | None = "auto", trust_remote_code: bool = False,
                   attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                   quantization: str | None = None, task: str = "causal-lm", num_labels: int = 1):
    """Load a causal LM (or, with task='classifier', a sequence classifier) by id, path or tiny:name.

    `quantization` = '4bit' | '8bit' loads the weights through bitsandbytes (QLoRA). A PEFT adapter
    directory (a LoRA run's output) loads as its base model with the adapter merged, so one stage's
    output is the next stage's `model_name` whether or not it trained LoRA."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    # A causal-LM checkpoint loads as a classifier too (new score head): how reward models start.
    path = resolve_model_path(name)
    base = adapter_base(path)
    if base is not None and task != "classifier" and (Path(path) / "reward_config.json").is_file():
        # a LoRA reward model's directory holds a PEFT sequence-classification adapter: not a policy
        raise ConfigError(f"model {name!r} is a reward model (LoRA adapter of a classifier), not a causal LM; "
                          f"load it with rl.reward.load_reward_model or use it as reward_model_path")
    if base is not None:  # a LoRA run's output: its base with the adapter merged in, a plain model again
        from peft import PeftModel

        # Merged on whole tensors: under a ZeRO-3 launch, zero.Init would leave each process a shard to
        # merge into; DeepSpeed partitions the merged model when the engine is built instead.
        with _without_zero3_init():
            model = load_causal_lm(base, dtype, trust_remote_code, attn_implementation, gradient_checkpointing,
                                   quantization, task, num_labels)
            model = PeftModel.from_pretrained(model, path).merge_and_unload()
        # named after the adapter, so that a LoRA run on top records this directory as its base
        # (adapter_config.json's base_model_name_or_path), not the model under it
        model.name_or_path = model.config._name_or_path = str(path)
        return model
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if quantization in ("4bit", "8bit"):
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch_dtype, bnb_4bit_use_double_quant=True)
            if quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    try:
        if task == "classifier":
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise not_loadable(name, "weights", e) from None
    if task == "classifier" and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def load_trainable_policy(cfg):
    """The policy a trainer optimises, from a TrainConfig: fp32 master weights (bf16 compute comes
    from autocast / DeepSpeed), the recipe's attention kernel and gradient checkpointing."""
    return load_causal_lm(cfg.model_name, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                          attn_implementation=cfg.attn_implementation,
                          gradient_checkpointing=cfg.gradient_checkpointing)


def apply_lora(model, rank: int = 16, alpha: int = 32, dropout: float = 0.05,
               target_modules: str | list[str] = "all-linear", task_type: str = "CAUSAL_LM",
               modules_to_save: list[str] | None = None):
    """Wrap `model` with LoRA adapters. 'all-linear' adapts every linear layer but the output head,
    so GPT-2 (Conv1D c_attn), Llama, Qwen2 and Gemma all work without naming their modules."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = [m.strip() for m in target_modules.split(",") if m.strip()]
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                     task_type=task_type, modules_to_save=modules_to_save)
    return get_peft_model(model, cfg)


def freeze(model):
    """A frozen copy for reference/reward use: eval mode, no gradients."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def trainable_fraction(model) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    def numel(p):  # ZeRO-3 partitions parameters at load time; ds_numel is the full size
        return getattr(p, "ds_numel", None) or p.numel()

    total = sum(numel(p) for p in model.parameters())
    train = sum(numel(p) for p in model.parameters() if p.requires_grad)
    return train, total


def build_optimizer(model, learning_rate: float, weight_decay: float = 0.0):
    """AdamW over trainable parameters; no decay on biases and norms (the usual transformer recipe)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=learning_rate)


def build_scheduler(optimizer, kind: str, total_steps: int, warmup_ratio: float = 0.0,
                    warmup_steps: int | None = None):
    """Linear warmup then constant / linear decay / cosine decay to zero over `total_steps`."""
    warmup = warmup_steps if warmup_steps is not None else int(round(warmup_ratio * total_steps))
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, 1.0 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def merge_lora_state_dict(state_dict: dict, scaling: float, fan_in_fan_out: bool = False,
                          adapter: str = "default") -> dict:
    """A PEFT LoRA model's full state dict -> the plain base model's, with W' = W + scaling * B @ A.

    Works on a gathered (ZeRO-3) state dict, where `merge_and_unload` cannot be used because the
    live modules only hold shards. Keys lose PEFT's `base_model.model.` prefix and `.base_layer`;
    `modules_to_save` copies replace their originals. Conv1D layers (GPT-2) store W transposed."""
    prefix = "base_model.model."
    out: dict = {}
    for key, value in state_dict.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        name = key[len(prefix):] if key.startswith(prefix) else key
        name = name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        if key.endswith(".base_layer.weight"):
            module = key[: -len(".base_layer.weight")]
            a = state_dict.get(f"{module}.lora_A.{adapter}.weight")
            b = state_dict.get(f"{module}.lora_B.{adapter}.weight")
            if a is not None and b is not None:
                delta = (b.float() @ a.float()) * scaling
                value = (value.float() + (delta.T if fan_in_fan_out else delta)).to(value.dtype)
        out[name] = value
    return out


MERGED_DIR = "merged"  # where `save_merged: true` puts a LoRA run's merged model, under the output dir


def is_lora(model) -> bool:
    """True for a PEFT model whose (default) adapter is LoRA."""
    cfg = getattr(model, "peft_config", {}).get("default") if hasattr(model, "peft_config") else None
    return cfg is not None and str(getattr(cfg, "peft_type", "")).endswith("LORA")


def adapter_base(path: str | Path) -> str | None:
    """The base model a PEFT adapter directory names (`base_model_name_or_path` of its
    `adapter_config.json`), or None when `path` is not an adapter directory."""
    f = Path(path) / "adapter_config.json"
    if not f.is_file() or (Path(path) / "config.json").exists():
        return None
    try:
        return json.loads(f.read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError):
        return None


def save_pretrained(model, tokenizer, out_dir: str, accelerator=None, merged: bool = False) -> None:
    """Save the final model where `from_pretrained` finds it (see `write_pretrained` for the layout).

    Under ZeRO-3 every process must call this (the weights are gathered); only the main one writes."""
    if accelerator is not None:
        state_dict = accelerator.get_state_dict(model)
        if not accelerator.is_main_process:
            return
        model = accelerator.unwrap_model(model)
    else:
        state_dict = None
    write_pretrained(model, state_dict, tokenizer, out_dir, merged=merged)


def write_pretrained(model, state_dict: dict | None, tokenizer, out_dir, merged: bool = False) -> None:
    """Write `model` (with `state_dict` if given, e.g. gathered from ZeRO-3 shards) under `out_dir`.

    A full model: an HF model directory (config.json + model.safetensors + tokenizer). A LoRA model: the
    PEFT adapter (adapter_config.json + adapter_model.safetensors + tokenizer), as TRL writes it, which
    `PeftModel.from_pretrained(base, out_dir)`, `AutoPeftModelForCausalLM.from_pretrained(out_dir)` and our
    own loader (`load_causal_lm`, which merges it) read; with `merged=True` also the merged full model in
    `out_dir/merged`. Both are written from the state dict, not from the live modules, so this works
    when those hold only ZeRO-3 shards. Call it on one process."""
    if is_lora(model):
        sd = state_dict if state_dict is not None else model.state_dict()
        # PEFT picks the adapter's tensors out of the full state dict it is given
        model.save_pretrained(str(out_dir), state_dict=sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        if merged:
            write_merged_lora(model, sd, tokenizer, Path(out_dir) / MERGED_DIR)
        return
    if hasattr(model, "peft_config"):  # another PEFT method: merged by PEFT on the live modules
        model = model.merge_and_unload()
        state_dict = None
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def write_merged_lora(model, state_dict: dict, tokenizer, out_dir) -> None:
    """The LoRA model `model` merged into its base (W' = W + scaling * B @ A, from `state_dict`) as a
    plain HF model directory that loads without peft."""
    from huggingface_hub import save_torch_state_dict

    cfg = model.peft_config["default"]
    scaling = cfg.lora_alpha / (cfg.r ** 0.5 if getattr(cfg, "use_rslora", False) else cfg.r)
    merged = merge_lora_state_dict(state_dict, scaling, bool(getattr(cfg, "fan_in_fan_out", False)))
    base = model.get_base_model()
    base.config.save_pretrained(out_dir)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(out_dir)
    save_torch_state_dict({k: v.detach().cpu().contiguous() for k, v in merged.items()}, out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def release_device_cache() -> None:
    """Hand the accelerator's cached, unused memory back (`optimize_device_cache`): generation's KV cache
    and training's activations then do not both sit in the allocator's cache. Costs a little speed; a
    no-op on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
