"""The reward model's files: safetensors + JSON, never pickles.

A directory written by `save_reward_model` holds `reward_config.json` (kind, RewardModelConfig,
objective weights, what else is there) and the head in `reward_head.safetensors`, and then either
* LoRA (QLoRA included): the adapter alone in `adapter.safetensors` (the base is reloaded from
  `model_name`), and the same adapter as PEFT writes one for `AutoModelForSequenceClassification`
  (`write_peft_classifier_adapter`), or
* a full fine-tune: `config.json` + `model.safetensors` in the layout of
  `AutoModelForSequenceClassification`, with `temperature` folded into `score.weight`,
plus the tokenizer. `hf_compatible` records whether plain transformers gives the same rewards (`last`
pooling, no head bias, and the EOS ending each text is not the pad id). `load_reward_weights` reads
it back (ZeRO-3 aware), and `reward_model_problem` says in one line why a directory is not a reward
model (a causal LM would get a random score head and train the policy against noise).

Kept apart from the model classes (rl.models.reward) so that this module needs no model: every
function takes the model it writes or fills as an argument.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

FORMAT = "rl-reward-model"
CONFIG_FILE = "reward_config.json"
HEAD_FILE = "reward_head.safetensors"
ADAPTER_FILE = "adapter.safetensors"
HF_WEIGHTS_FILE = "model.safetensors"


def _is_zero3_param(p) -> bool:
    return hasattr(p, "ds_id")


def _load_partial(model: nn.Module, sd: dict) -> None:
    """Load `sd` into `model` (keys relative to it); every key must exist. ZeRO-3 aware."""
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    unknown = [k for k in sd if k not in own]
    if unknown:
        raise KeyError(f"checkpoint has weights this model lacks (different base model or LoRA "
                       f"settings?): {unknown[:3]}")
    params = [own[k] for k in sd if isinstance(own[k], nn.Parameter)]
    ctx = _gathered(params, modifier_rank=0) if any(_is_zero3_param(p) for p in params) else _null()
    with ctx, torch.no_grad():
        for k, v in sd.items():
            own[k].data.copy_(v.to(own[k].device, own[k].dtype).reshape(own[k].shape))



def _gathered(params, modifier_rank=None):
    import deepspeed  # heavy and optional: only under ZeRO-3

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def save_reward_model(model: nn.Module, path: str | Path, state_dict: dict | None = None) -> Path:
    """Write `model` to directory `path`: safetensors + JSON only.

    * `reward_config.json`: kind, RewardModelConfig, objective weights, what else is in the dir.
    * `reward_head.safetensors`: the head, exactly.
    * LoRA (incl. QLoRA): `adapter.safetensors`, the adapter weights only; the base model is
      reloaded from `config.model_name` (quantized again if it was). Also the same adapter as a PEFT
      adapter of `AutoModelForSequenceClassification` (`adapter_config.json` + `adapter_model.safetensors`,
      the head / temperature as its `score` module), for `PeftModel.from_pretrained(classifier, path)`.
    * full fine-tune: `config.json` + `model.safetensors` in the layout of
      `AutoModelForSequenceClassification` (head / temperature in `score.weight`) + tokenizer.

    `state_dict` (the model's full state dict, e.g. gathered under ZeRO-3) defaults to the model's.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = state_dict if state_dict is not None else model.state_dict()
    sd = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
    meta = model._meta()
    head = {k[len("head."):]: v.clone() for k, v in sd.items() if k.startswith("head.")}
    save_file(head, str(path / HEAD_FILE))
    if model.config.use_lora:
        adapter = {k[len("backbone."):]: v.clone() for k, v in sd.items()
                   if k.startswith("backbone.") and "lora_" in k}
        save_file(adapter, str(path / ADAPTER_FILE))
        write_peft_classifier_adapter(model, sd, head["weight"], path)
        meta.update(weights="lora", hf_compatible=hf_compatible(model, head))
    else:
        prefix = model.hf_prefix
        hf_sd = {f"{prefix}.{k[len('backbone.'):]}": v.clone() for k, v in sd.items() if k.startswith("backbone.")}
        w = head["weight"]
        hf_sd["score.weight"] = (w.float() / model.config.temperature).to(w.dtype)
        save_file(hf_sd, str(path / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        hf_cfg = model.hf_config
        hf_cfg.num_labels = model.config.num_labels
        hf_cfg.save_pretrained(str(path))
        meta.update(weights="full", hf_prefix=prefix, hf_compatible=hf_compatible(model, head))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return path


def hf_compatible(model: nn.Module, head: dict) -> bool:
    """Whether `AutoModelForSequenceClassification` (or a PEFT adapter on it) gives this model's rewards.
    HF's classifier reads the last token that is not the pad id, with a bias-free head: our rewards
    exactly when pooling is `last`, the head has no bias, and the EOS ending each text is not the pad
    id (with pad == eos, as in SmolLM2, HF reads the token before that EOS)."""
    eos = model.hf_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    pad_ends_texts = model.config.append_eos and model.pad_token_id in eos
    return model.config.pooling_strategy == "last" and "bias" not in head and not pad_ends_texts


def write_peft_classifier_adapter(model: nn.Module, sd: dict, head_weight: torch.Tensor, path: Path) -> None:
    """The LoRA reward model's adapter as PEFT writes one for `AutoModelForSequenceClassification`
    (task SEQ_CLS): PEFT's own key names for the backbone's adapter, moved under the classifier's
    backbone attribute (`base_model.model.<hf_prefix>.`), and `score.weight` = head / temperature as a
    module to save. `sd` is the model's full state dict (keys `backbone.*`, `head.*`)."""
    from peft import (
        get_peft_model_state_dict,  # optional dependency: only for LoRA models
    )

    backbone_sd = {k[len("backbone."):]: v for k, v in sd.items() if k.startswith("backbone.")}
    peft_sd = get_peft_model_state_dict(model.backbone, state_dict=backbone_sd)
    inner = "base_model.model."
    out = {f"{inner}{model.hf_prefix}.{k[len(inner):]}": v for k, v in peft_sd.items()}
    out[f"{inner}score.weight"] = (head_weight.float() / model.config.temperature).to(head_weight.dtype)
    save_file(out, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = copy.deepcopy(model.backbone.peft_config["default"])
    cfg.task_type, cfg.modules_to_save, cfg.inference_mode = "SEQ_CLS", ["score"], True
    cfg.save_pretrained(str(path))


def reward_model_problem(path: str | Path) -> str | None:
    """Why directory `path` is not a reward model, or None: it must hold a reward_config.json (written by
    launch/reward.py) or be a `*ForSequenceClassification` checkpoint. A causal LM would get a randomly
    initialised score head and train the policy against noise, so it is refused."""
    p = Path(path)
    if (p / CONFIG_FILE).exists():
        return None
    if not (p / "config.json").exists():
        return (f"{path} has no {CONFIG_FILE} or config.json; pass the directory written by launch/reward.py "
                f"(or RewardModelTrainer.save_model)")
    try:
        archs = json.loads((p / "config.json").read_text()).get("architectures") or []
    except (ValueError, UnicodeDecodeError) as e:
        return f"{p / 'config.json'} is not valid JSON ({e})"
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return (f"{path} is not a reward model (architectures {archs or 'unknown'}, no {CONFIG_FILE}): its score "
                f"head would be random; train one with launch/reward.py or give a *ForSequenceClassification "
                f"checkpoint")
    return None


def load_reward_weights(model: nn.Module, path: str | Path) -> None:
    """Load head and adapters (LoRA) or all weights (full) written by `save_reward_model` into `model`."""
    path = Path(path)
    meta = json.loads((path / CONFIG_FILE).read_text())
    sd = {f"head.{k}": v for k, v in load_file(str(path / HEAD_FILE)).items()}
    if meta["weights"] == "lora":
        if not model.config.use_lora:
            raise ValueError(f"{path} holds LoRA adapters but this model has use_lora=false")
        sd.update({f"backbone.{k}": v for k, v in load_file(str(path / ADAPTER_FILE)).items()})
    else:
        if model.config.use_lora:
            raise ValueError(f"{path} holds a full model but this model has use_lora=true; "
                             f"load it with load_reward_model({str(path)!r})")
        prefix = meta["hf_prefix"] + "."
        sd.update({"backbone." + k[len(prefix):]: v for k, v in load_file(str(path / HF_WEIGHTS_FILE)).items()
                   if k.startswith(prefix)})
    _load_partial(model, sd)
