"""The model card (`README.md`) of a run's output directory, written with huggingface_hub's `ModelCard`.

What a reader of the directory needs to know without the run's logs: the base model, the trainer and
its algorithm settings, the recipe and data, the final metrics, the exact command and the library
versions, and how to load what is there (`output_contents`: a full model, a PEFT adapter with an
optional merged copy, or a reward model). The YAML header uses the hub's model-card fields
(`base_model`, `library_name`, `tags`, ...), so the card reads as one on the hub would; nothing is
pushed. `write_model_card` replaces the template card PEFT writes beside an adapter.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import sys
from pathlib import Path

from rl.config.parse import to_dict
from rl.models.saving import adapter_base

# settings that name the algorithm a trainer ran (whichever its config has)
ALGORITHM_KEYS = ("loss_type", "advantage_estimator", "loss_aggregation", "policy_loss", "kl_estimator",
                  "value_model", "reward_fn", "env_type", "beta", "kl_coef", "kl_penalty_coef")
LIBRARIES = ("rl-finetune", "torch", "transformers", "accelerate", "peft", "deepspeed", "trl", "datasets",
             "huggingface_hub")
# not metrics a reader compares runs by
_NOT_METRICS = ("step", "time", "step_time")


def library_versions() -> dict[str, str]:
    """{distribution: version} of the libraries that decide a run's numerics (absent ones left out)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def final_metrics(history: list[dict]) -> dict[str, float]:
    """The last logged value of every numeric metric, in first-seen order (eval/ rows included)."""
    last: dict[str, float] = {}
    for row in history:
        for key, value in row.items():
            if key not in _NOT_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool):
                last[key] = value
    return last


def _hub_id(name: str) -> str | None:
    """`name` when it looks like a hub id (`org/model`, `gpt2`), else None: local paths and tiny: names
    are not valid `base_model` values on the hub."""
    if name.startswith(("tiny:", "/", ".", "~")) or name.count("/") > 1 or Path(name).exists():
        return None
    return name


def card_text(cfg, history: list[dict], trainer: str, argv: list[str] | None = None,
              contents: str = "model", directory: str | None = None, recipe: str | None = None) -> str:
    """The card as markdown with a YAML header. `contents`: 'model' (a full HF model directory),
    'adapter' (a PEFT adapter), 'adapter+merged' (an adapter and `merged/`), 'reward' (our reward-model
    format)."""
    from huggingface_hub import ModelCardData

    settings = to_dict(cfg)
    algorithm = {k: settings[k] for k in ALGORITHM_KEYS if settings.get(k) is not None}
    peft = contents.startswith("adapter")
    d = settings.get("data") or {}
    data = d.get("path") or ", ".join(f"{e['path']} x{e['weight']}" for e in d.get("mixture") or []) or None
    tags = ["rl-finetune", trainer] + (["lora", "peft"] if peft else [])
    meta = ModelCardData(base_model=_hub_id(cfg.model_name), library_name="peft" if peft else "transformers",
                         pipeline_tag="text-classification" if contents == "reward" else "text-generation",
                         tags=tags, model_name=Path(cfg.output_dir).name)
    command = shlex.join([Path(sys.executable).name] + list(sys.argv if argv is None else argv))
    lines = [f"# {Path(cfg.output_dir).name}", "",
             f"Fine-tuned from `{cfg.model_name}` with the **{trainer}** trainer of rl-finetune.", "",
             "| | |", "|---|---|",
             f"| base model | `{cfg.model_name}` |",
             f"| trainer | {trainer} |",
             f"| algorithm | {', '.join(f'{k}={v}' for k, v in algorithm.items()) or trainer} |",
             f"| LoRA | {'rank %s, alpha %s' % (cfg.lora.rank, cfg.lora.alpha) if cfg.lora.enabled else 'no'} |",
             f"| data | `{data}` |" if data else "| data | (from the recipe's environment) |",
             f"| recipe | `{recipe}` (every resolved setting) |" if recipe else
             "| recipe | (not saved) |",
             "", "## Command", "", "```bash", command, "```", ""]
    metrics = final_metrics(history)
    if metrics:
        lines += ["## Final metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.6g} |" for k, v in metrics.items()]
        lines += [""]
    lines += ["## Files and loading", ""] + _loading(contents, directory or cfg.output_dir)
    if (Path(directory or cfg.output_dir) / "value_head.safetensors").exists():
        lines += ["", "PPO's value head is beside it in `value_head.safetensors` (keys of `rl.trainers.ppo_math.ValueHead`; "
                      "the policy above loads without it)."]
    lines += ["", "## Library versions", "", "| library | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in library_versions().items()]
    return f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"


def _loading(contents: str, out: str) -> list[str]:
    if contents == "reward":
        text = ["A reward model in rl-finetune's format (`reward_config.json`); load it with "
                "`rl.models.reward.load_reward_model(path)` or give the directory as `reward_model_path`."]
        peft = (Path(out) / "adapter_config.json").exists()
        text += ["", "Without this package, as a sequence classifier (the same rewards when `reward_config.json` "
                     "says `hf_compatible`):", "", "```python",
                 "from transformers import AutoModelForSequenceClassification"]
        if peft:
            base, labels = adapter_base(out), _num_labels(Path(out) / "reward_config.json")
            text += ["from peft import PeftModel", "",
                     f"base = AutoModelForSequenceClassification.from_pretrained({base!r}, num_labels={labels})",
                     f"model = PeftModel.from_pretrained(base, {out!r})"]
        else:
            text += ["", f"model = AutoModelForSequenceClassification.from_pretrained({out!r})"]
        return text + ["```"]
    if contents.startswith("adapter"):
        text = ["A PEFT LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`) and the tokenizer:",
                "", "```python", "from peft import AutoPeftModelForCausalLM",
                f"model = AutoPeftModelForCausalLM.from_pretrained({out!r})", "```"]
        base = adapter_base(out)
        if base is not None and adapter_base(base) is not None:
            text += ["", f"**Stacked adapter**: its base `{base}` is itself an adapter. PEFT's loaders would "
                         f"apply this one to that adapter's base without it (wrong weights); load it with "
                         f"`rl.models.loading.load_causal_lm({out!r})`, which merges the chain, or use `merged/` "
                         f"(`save_merged: true`)."]
        if contents.endswith("merged"):
            text += ["", f"`merged/` holds the adapter merged into the base model: "
                         f"`AutoModelForCausalLM.from_pretrained({str(Path(out) / 'merged')!r})`."]
        return text
    return ["A full model (`config.json`, `model.safetensors`) and the tokenizer:", "", "```python",
            "from transformers import AutoModelForCausalLM", f"model = AutoModelForCausalLM.from_pretrained({out!r})",
            "```"]


def _num_labels(reward_config: Path) -> int:
    try:
        return int(json.loads(reward_config.read_text())["config"]["num_labels"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def output_contents(out_dir: str | Path) -> str:
    """What a run wrote to `out_dir`: 'adapter+merged', 'adapter', 'reward' or 'model'."""
    out = Path(out_dir)
    if (out / "reward_config.json").exists():  # a LoRA reward model holds a (classifier's) PEFT adapter too
        return "reward"
    if (out / "adapter_config.json").exists():
        return "adapter+merged" if (out / "merged" / "config.json").exists() else "adapter"
    return "model"


def write_model_card(out_dir: str | Path, cfg, history: list[dict], trainer: str,
                     argv: list[str] | None = None) -> Path:
    """Write `<out_dir>/README.md` (replacing PEFT's template card) and, after a LoRA run with
    `save_merged`, the same card in `merged/`. Call it on the main process after the final save."""
    from huggingface_hub import ModelCard

    out = Path(out_dir)
    contents = output_contents(out)
    path = out / "README.md"
    recipe = next((n for n in ("config.yaml", "recipe.yaml") if (out / n).exists()), None)
    ModelCard(card_text(cfg, history, trainer, argv, contents, str(out), recipe)).save(path)
    if contents == "adapter+merged":
        card = card_text(cfg, history, trainer, argv, "model", str(out / "merged"), recipe and f"../{recipe}")
        ModelCard(card).save(out / "merged" / "README.md")
    return path
