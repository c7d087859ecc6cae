"""PPO's models: the policy with a value head (`PPOModel`, `ValueHead`), a separate critic (`Critic`), and
the files a PPO policy is written to and read from.

`PPOModel.forward` returns the LM's logits and, without a KV cache, `value` (B, T): value[:, t] is V of
the state after reading tokens 0..t, one value per token (the reference gave one per sequence). Position
ids count from each row's first attended token, so left padding changes nothing, exactly as during
sampling. Reading those per-position outputs in response space (response token j of a batch
[left-padded prompt (P) | response (N)] is predicted and valued at position P - 1 + j) is
rl.trainers.ppo_math's part. The value head's output layer starts at zero, so the first values are 0
and the first advantages are the rewards themselves. `Critic` applies a reward model's backbone and
head at every position (TRL's value model initialised from the reward model).

Files (`write_policy` / `load_policy_weights`): the policy alone in the layout
`AutoModelForCausalLM.from_pretrained` (LoRA: `PeftModel`) reads without this package, and the value
head beside it in `value_head.safetensors`.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers.utils import ModelOutput

from rl.engine.packing import position_ids_from_mask
from rl.engine.state import load_deduped_state_dict
from rl.models.saving import is_lora, write_pretrained

VALUE_HEAD_FILE = "value_head.safetensors"


@dataclasses.dataclass
class PPOModelOutput(ModelOutput):
    """A transformers ModelOutput (attribute and key access), so that DeepSpeed's ZeRO-3 hooks and
    accelerate treat it like any model's output instead of warning about an unknown type."""

    logits: torch.Tensor | None = None  # (B, T, V)
    value: torch.Tensor | None = None  # (B, T): V of the state after reading tokens 0..t
    cache: Any = None  # the KV cache (transformers 5 renamed past_key_values to cache)


class ValueHead(nn.Module):
    """hidden -> Linear -> ReLU -> Linear -> one value per token, (B, T, H) -> (B, T), fp32 output.

    The output layer starts at zero, so the first values are 0 and the first advantages are the
    rewards themselves rather than noise from a random head."""

    def __init__(self, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = nn.ReLU()
        self.out = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.to(self.dense.weight.dtype)
        return self.out(self.act(self.dense(self.dropout(h)))).squeeze(-1).float()


class PPOModel(nn.Module):
    """A causal LM plus a `ValueHead` on its last hidden state: logits and one value per token.

    `forward` takes what the HF model takes. Without a KV cache it also returns `value` (B, T); with
    one (sampling) the head is skipped. Position ids default to counting from each row's first
    attended token, so left padding changes nothing (as in `rl.engine.generation`). `value_head=False` makes
    a policy without a head (when a separate critic is used)."""

    def __init__(self, base_model: nn.Module, value_head: bool | ValueHead = True):
        super().__init__()
        self.base_model = base_model
        # the KV-cache keyword of this transformers version ("cache" replaced "past_key_values")
        params = inspect.signature(getattr(base_model, "get_base_model", lambda: base_model)().forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        hidden = base_model.config.get_text_config().hidden_size
        if value_head is True:
            value_head = ValueHead(hidden)
        self.value_head = value_head or None

    @property
    def config(self):
        return self.base_model.config

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, **kwargs) -> PPOModelOutput:
        cache = cache if cache is not None else past_key_values
        if position_ids is None and attention_mask is not None and cache is None:
            position_ids = position_ids_from_mask(attention_mask)
        want_value = self.value_head is not None and cache is None
        if cache is not None:
            kwargs[self._cache_kw] = cache
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache, output_hidden_states=want_value, **kwargs)
        value = self.value_head(out.hidden_states[-1]) if want_value else None
        return PPOModelOutput(logits=out.logits, value=value, cache=getattr(out, "cache", None))

    # the engine's checkpoint hooks (rl.engine.pipeline): `checkpoint-N/` holds what the final output holds
    def save_checkpoint_weights(self, state_dict: dict, out_dir: Path) -> None:
        write_policy(self, state_dict, out_dir)

    def load_checkpoint_weights(self, ckpt: Path) -> None:
        load_policy_weights(self, ckpt)


class Critic(nn.Module):
    """A separate value model: a reward model's backbone and head applied at every position (the
    value model TRL's PPO initialises from the reward model). (B, T) values, fp32."""

    def __init__(self, reward_model: nn.Module):
        super().__init__()
        self.backbone = reward_model.backbone
        self.head = reward_model.head
        self.scale = 1.0 / float(getattr(reward_model.config, "temperature", 1.0))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs) -> PPOModelOutput:
        """Packed rows (`rl.engine.packing`): position_ids and no attention_mask; the backbone then gets no mask."""
        if attention_mask is None and position_ids is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        value = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float() * self.scale
        return PPOModelOutput(value=value)


def write_policy(model: PPOModel, state_dict: dict, out_dir, tokenizer=None, merged: bool = False) -> None:
    """Write a PPOModel from its full `state_dict` (gathered under ZeRO-3) as the policy alone, the
    layout `AutoModelForCausalLM.from_pretrained(out_dir)` (LoRA: `PeftModel` / `AutoPeftModelForCausalLM`)
    reads without this package, plus the value head beside it in `value_head.safetensors` (its keys
    relative to `ValueHead`). LoRA writes the adapter only (and with `merged` the merged model in
    `merged/`); the frozen base is the one `model_name` names. Call it on one process."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = "base_model."
    base_sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    head_sd = {k[len("value_head."):]: v.detach().cpu().contiguous() for k, v in state_dict.items()
               if k.startswith("value_head.")}
    # LoRA is merged from the gathered state dict (a copy of ZeRO-3 shards would be empty)
    write_pretrained(model.base_model, base_sd, tokenizer, out_dir, merged=merged)
    if head_sd:
        save_file(head_sd, str(out_dir / VALUE_HEAD_FILE))


def load_policy_weights(model: PPOModel, path) -> None:
    """Load what `write_policy` wrote in `path` into a PPOModel built as the saved one (not ZeRO-3
    partitioned: there the engine reads its own DeepSpeed files): every weight of a full model, the
    adapter of a LoRA model (its frozen base is rebuilt from `model_name`), and the value head."""
    path = Path(path)
    if is_lora(model.base_model):
        from peft import (
            set_peft_model_state_dict,  # optional dependency: only for LoRA policies
        )

        adapter = load_file(str(path / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model.base_model, adapter)
        n_lora = sum(1 for k, _ in model.base_model.named_parameters() if ".lora_" in k)
        if result.unexpected_keys or len(adapter) != n_lora:
            raise KeyError(f"{path}: adapter_model.safetensors has {len(adapter)} tensors for this model's "
                           f"{n_lora} LoRA parameters (unexpected: {result.unexpected_keys[:3]})")
    else:
        load_deduped_state_dict(model.base_model, load_file(str(path / "model.safetensors")))
    if model.value_head is not None:
        model.value_head.load_state_dict(load_file(str(path / VALUE_HEAD_FILE)))
