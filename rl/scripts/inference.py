"""Using a trained model: load any output directory, format prompts as in training, generate.

Shared by `launch/chat.py` (talk to a model) and `launch/eval.py` (held-out accuracy on prompt/answer
data), so both see a model exactly as the trainers did:

* Loading (`load_for_inference`): a full model directory (config.json + weights), a hub id, a
  `tiny:<family>` name, or a PEFT adapter directory (adapter_config.json): the adapter's base model is
  loaded (our `tiny:`/GGUF names resolved first, which peft's AutoPeftModelForCausalLM cannot), the
  adapter applied with `PeftModel.from_pretrained` and merged, so generation runs at full speed.
* Prompts (`encode`): BOS + tokens, with `add_special_tokens=False` and BOS added once (rl.data.records.with_bos),
  as rl.trainers.grpo.encode_prompt and the SFT trainer tokenise; with `chat`, the user turn is first rendered
  with the tokenizer's chat template and the assistant header.
* `chat_setting(model_dir, choice, default)`: 'auto' reads the run's own `config.yaml`
  (`chat_template`), so an output directory is prompted the way it was trained; a base model or a run
  without the key gets the caller's default (chat: the template when there is one; eval: plain).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml

from rl.engine.generation import generate
from rl.errors import ConfigError
from rl.models.limits import prompt_room
from rl.models.loading import check_source, load_causal_lm, load_tokenizer, unreadable
from rl.rollout.prompts import encode_prompt, keep_last


def load_for_inference(name: str, dtype: str = "auto", trust_remote_code: bool = False):
    """(model in eval mode, tokenizer with left padding) for an output directory, hub id or tiny name.

    A directory with adapter_config.json is a PEFT adapter: base model + adapter, merged."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar is noise in chat and eval output
    path = Path(name)
    check_source(name, name)  # a missing directory, a reward model: one line before anything loads
    adapter = path / "adapter_config.json"
    if path.is_dir() and adapter.exists():
        from peft import PeftModel  # heavy; only adapter directories need it

        try:
            base = json.loads(adapter.read_text())["base_model_name_or_path"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{adapter}: not a PEFT adapter config (no base_model_name_or_path); "
                              f"point --model at a full model or a directory peft saved") from None
        model = load_causal_lm(base, dtype=dtype, trust_remote_code=trust_remote_code)
        try:
            model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
        except Exception as e:  # noqa: BLE001 - refused or unreadable adapter weights: one line
            raise (unreadable(name, e, path) or e) from None
        has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        tok = load_tokenizer(str(path) if has_tokenizer else base, trust_remote_code, padding_side="left")
    elif path.is_dir() and not (path / "config.json").exists():
        raise ConfigError(f"{name}: no model here (neither config.json nor adapter_config.json); point "
                          f"--model at a run's output directory, a hub id or tiny:llama")
    else:
        model = load_causal_lm(name, dtype=dtype, trust_remote_code=trust_remote_code)
        tok = load_tokenizer(name, trust_remote_code, padding_side="left")
    model.eval()
    return model, tok


def chat_setting(model_name: str, choice: str, default: bool) -> bool:
    """Whether to render prompts with the chat template: 'yes', 'no', or 'auto': the run's own
    config.yaml `chat_template` value when `model_name` is an output directory that records one (GRPO,
    PPO, DPO runs), else `default`."""
    if choice in ("yes", "no"):
        return choice == "yes"
    recipe = Path(model_name) / "config.yaml"
    try:
        saved = yaml.safe_load(recipe.read_text()) if recipe.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError):
        saved = None
    if isinstance(saved, dict) and isinstance(saved.get("chat_template"), bool):
        return saved["chat_template"]
    return default


def encode(tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """Token ids of one prompt as the trainers build them (`rl.rollout.prompts.encode_prompt`)."""
    return encode_prompt(tokenizer, prompt, None, chat)


@torch.no_grad()
def complete(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, batch_size: int = 16,
             name: str = "the model") -> list[str]:
    """Decoded completions (special tokens dropped) of `prompt_ids`, `batch_size` prompts at a time.

    `temperature=0` is greedy; otherwise seeded sampling (rl.engine.generation: row r of a batch starting at
    prompt i draws from seed `seed + i + r`, so results do not depend on batch_size). A prompt longer than
    the model's context leaves next to max_new_tokens keeps its last tokens, as the trainers cut prompts,
    with one warning line; a max_new_tokens that leaves no room is refused (rl.models.limits.prompt_room)."""
    room = prompt_room(model, max_new_tokens, name)
    cut = sum(room is not None and len(p) > room for p in prompt_ids)
    if cut:
        print(f"warning: {cut} prompt(s) longer than {name}'s context leaves next to {max_new_tokens} new tokens "
              f"keep their last {room} tokens (lower --max-completion-length to keep more)", file=sys.stderr)
        prompt_ids = [keep_last(p, room, getattr(tokenizer, "bos_token_id", None)) for p in prompt_ids]
    out: list[str] = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        roll = generate(model, tokenizer, chunk, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_p=top_p, seed=seed + start)
        out += tokenizer.batch_decode(roll.completions(), skip_special_tokens=True)
    return out
