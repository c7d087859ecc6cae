"""Writing models where `from_pretrained` finds them: the final output directory, and the loadable files
beside a checkpoint's weights.

A full model is written as an HF model directory (config.json + model.safetensors + tokenizer); a LoRA
model as its PEFT adapter (adapter_config.json + adapter_model.safetensors), as TRL writes it, and with
`merged` also as the merged model in `<out>/merged` (MERGED_DIR). Everything is written from a state
dict, not from the live modules, so it works when those hold only ZeRO-3 shards: `save_pretrained`
gathers on every process and writes on the main one, `write_pretrained` writes what it is given, and
`merge_lora_state_dict` merges on plain tensors, W' = W + scaling * B @ A (scaling = alpha / r, or
alpha / sqrt(r) with rsLoRA; Conv1D weights are stored transposed). `make_loadable` turns an engine
checkpoint `checkpoint-N/` into a directory `from_pretrained` reads, as TRL's are. `adapter_base` names
the base model of an adapter directory, `is_lora` tells a LoRA model.
"""

from __future__ import annotations

import json
from pathlib import Path


def make_loadable(ckpt: str | Path, model, tokenizer=None) -> bool:
    """Write what `from_pretrained` needs beside a checkpoint's weights, as TRL's `checkpoint-N/` hold it:
    for a plain causal LM its `config.json` (+ generation config), for a LoRA model the PEFT adapter
    (`adapter_config.json` + `adapter_model.safetensors`, its tensors read from the checkpoint's
    `model.safetensors`, so ZeRO-3 needs no second gather), and the tokenizer. Models of our own that
    write their checkpoint files themselves (`save_checkpoint_weights`: PPO's policy with its value
    head, reward models) already did; they get the tokenizer. Any other model: returns False.
    Call it on one process."""
    from transformers import PreTrainedModel

    ckpt = Path(ckpt)
    if hasattr(model, "save_checkpoint_weights"):
        pass
    elif is_lora(model):
        from safetensors import safe_open

        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            adapter = {k: f.get_tensor(k) for k in f.keys() if ".lora_" in k or ".modules_to_save." in k}
        model.save_pretrained(str(ckpt), state_dict=adapter, safe_serialization=True)
    elif isinstance(model, PreTrainedModel):
        model.config.save_pretrained(ckpt)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(ckpt)
    else:
        return False
    if tokenizer is not None:
        tokenizer.save_pretrained(ckpt)
    return True


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
