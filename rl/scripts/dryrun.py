"""The --dry-run report of every launch script: the plan of a run, without data or weights.

`--dry-run` (the `dry_run: true` key) prints the resolved config, the world size, per-device and global
batch sizes, accumulation, the ZeRO stage and offload, and the estimated GPU memory of the model states
(weights, gradients, optimizer) of each model the trainer holds. Parameter counts come from the model's
config alone: the architecture is instantiated on the meta device (accelerate's `init_empty_weights`),
so no weights are read or allocated, even for an 8B model.

Memory model (bytes per GPU; N parameters, T of them trainable, L the largest layer, W GPUs, p the
bytes of the weight dtype). The trainable formulas are DeepSpeed's own
(`estimate_zero3_model_states_mem_needs`, `estimate_zero2_model_states_mem_needs`; the test checks
them against it), generalised to LoRA (T < N) by counting frozen weights at p bytes:
  trainable, ZeRO-3:                 4L + (p(N-T) + 18T) / W          (18 = 2+2 bf16 weight/grad, 4 fp32
  trainable, ZeRO-3 + offload opt:   4L + pN / W                        grad, 4 fp32 master, 8 Adam m/v)
  trainable, ZeRO-3 + offload all:   4L
  trainable, ZeRO-2 (and 1):         pN + 18T / W ; with optimizer offload pN
  trainable, no DeepSpeed (DDP):     16T + p(N-T)                     (fp32 master weights + grads + Adam)
  frozen (reference):                pN / W + pL under ZeRO-3, else pN
  frozen reward model:               pN (replicated: it is not a DeepSpeed engine)
Activations, the KV cache of generation and the CUDA context come on top of these figures.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from rl.config.parse import to_dict
from rl.config.plan import prompts_step_problem
from rl.config.schema import OPTIMIZER_STATE_BYTES
from rl.data.records import HUB_ID, SUFFIXES, has_data
from rl.errors import ConfigError
from rl.models.hub import hub_plan
from rl.models.limits import check_length
from rl.models.saving import adapter_base
from rl.models.sources import resolve_model_path
from rl.scripts.common import KNOWN_CONFIGS


def known_config(name: str) -> dict | None:
    """The built-in config of `name` ('google/gemma-2-2b-it', 'meta-llama/Llama-3.1-8B-Instruct', ...)."""
    base = name.rstrip("/").split("/")[-1].lower().replace("meta-llama-", "llama-")
    for key in sorted(KNOWN_CONFIGS, key=len, reverse=True):
        if base == key or base.startswith(key + "-"):
            return dict(KNOWN_CONFIGS[key])
    return None


def load_model_config(name: str, trust_remote_code: bool = False):
    """A transformers config for `name` without downloading weights: tiny:* names, local directories,
    the Hugging Face cache, then `KNOWN_CONFIGS`. None when none of them knows the model."""
    from transformers import AutoConfig

    if name.startswith("tiny:"):
        name = resolve_model_path(name)
    base = adapter_base(name)
    if base is not None:  # a LoRA run's output: the base model's architecture
        return load_model_config(base, trust_remote_code)
    if Path(name).is_dir():
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    fields = known_config(name)
    if fields is not None:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    try:  # a model already in the Hugging Face cache; never the network (a dry run must be instant)
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception:
        return None


@dataclass
class ParamCount:
    total: int           # N, shared (tied) tensors counted once
    largest_layer: int   # L, the most parameters one module owns directly (usually the embedding)
    linear: int          # parameters in nn.Linear weights inside the blocks (what LoRA/4-bit touch)
    lora: int            # trainable LoRA parameters for the requested rank (0 without LoRA)


def count_parameters(config, task: str = "causal-lm", lora_rank: int = 0,
                     lora_targets: str | list[str] | None = "all-linear") -> ParamCount:
    """Count parameters by building the architecture on the meta device (no memory, no weights).

    `task='classifier'` counts a reward/value model: the backbone plus a 1-output score head."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if task == "classifier":
        config = copy.deepcopy(config)
        config.num_labels = 1
    cls = AutoModelForSequenceClassification if task == "classifier" else AutoModelForCausalLM
    with init_empty_weights():
        model = cls.from_config(config)
    model.tie_weights()  # measured: on the meta device from_config leaves lm_head untied
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    if lora_targets is None:  # peft's default for the architecture
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        lora_targets = list(defaults.get(config.model_type, ["q_proj", "v_proj"]))
    targets = None if lora_targets == "all-linear" else (
        {t.strip() for t in lora_targets.split(",")} if isinstance(lora_targets, str) else set(lora_targets))
    linear = lora = 0
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        # peft's all-linear leaves the output layer (lm_head / score) alone; so does 4-bit loading.
        if not isinstance(m, torch.nn.Linear) or leaf in ("lm_head", "score", "classifier"):
            continue
        linear += m.weight.numel()
        if lora_rank and (targets is None or leaf in targets):
            lora += lora_rank * (m.in_features + m.out_features)
    return ParamCount(total, largest, linear, lora)


# ---------------------------------------------------------------------------------- ZeRO settings

@dataclass
class ZeroSettings:
    stage: int                 # 0 = no DeepSpeed (single process or DDP)
    offload_optimizer: bool
    offload_param: bool
    source: str | None         # the ds_config file it came from


def zero_settings(ds_config: str | None = None) -> ZeroSettings:
    """ZeRO stage and offload from the recipe's ds_config, else from `accelerate launch`'s environment
    (--deepspeed_config_file / --zero_stage set ACCELERATE_DEEPSPEED_* variables)."""
    path = ds_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        zo = json.loads(Path(path).read_text()).get("zero_optimization", {})

        def on(key):
            return str(zo.get(key, {}).get("device", "none")).lower() in ("cpu", "nvme")

        return ZeroSettings(int(zo.get("stage", 0)), on("offload_optimizer"), on("offload_param"), path)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        env = os.environ.get
        return ZeroSettings(int(env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
                            env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") in ("cpu", "nvme"),
                            env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") in ("cpu", "nvme"),
                            "accelerate launch")
    return ZeroSettings(0, False, False, None)


# ------------------------------------------------------------------------------- memory estimates

def trainable_states_bytes(n: int, largest: int, world: int, zero: ZeroSettings, trainable: int | None = None,
                           frozen_bytes: float = 2.0, mixed_precision: bool = True, optim: str = "adamw_torch_fused") -> int:
    """GPU bytes of weights + gradients + AdamW states of a model being trained (formulas in the module
    docstring). n: all parameters, trainable: those with gradients (default all), largest: biggest layer."""
    t = n if trainable is None else trainable
    frozen = (n - t) * frozen_bytes
    per = 18 if mixed_precision else 16  # fp32 training drops the 16-bit weight and gradient copies
    per += OPTIMIZER_STATE_BYTES[optim] - 8  # the formulas' 8 are AdamW's two fp32 moments
    if zero.stage == 3:
        if zero.offload_param and zero.offload_optimizer:
            return int(4 * largest)
        if zero.offload_optimizer:
            return int(4 * largest + (frozen + t * frozen_bytes) / world)
        return int(4 * largest + frozen / world + per * t / world)
    if zero.stage in (1, 2):
        if zero.offload_optimizer:
            return int(n * frozen_bytes)
        return int(n * frozen_bytes + per * t / world)
    return int((16 + OPTIMIZER_STATE_BYTES[optim] - 8) * t + frozen)


def frozen_states_bytes(n: int, largest: int, world: int, zero: ZeroSettings, weight_bytes: float = 2.0) -> int:
    """GPU bytes of a frozen model's weights (reference or reward model): sharded only under ZeRO-3."""
    if zero.stage == 3:
        if zero.offload_param:
            return int(weight_bytes * largest)
        return int(weight_bytes * n / world + weight_bytes * largest)
    return int(weight_bytes * n)


def _looks_local(name: str) -> bool:
    """A path (runs/rm, ./out, /abs) rather than a Hub id (org/name): what a previous step would write."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name.split("/")[0]).is_dir()


def _dtype_bytes(dtype: str) -> float:
    return 4.0 if dtype == "float32" else 2.0  # auto = bf16 on the GPUs these estimates are for


def _role(label: str, spec) -> dict:
    """What the launch script's `models` entry means: trainable or frozen, causal LM or classifier,
    or no memory of its own (a reference that is the policy with LoRA off, or precomputed log-probs)."""
    if isinstance(spec, dict):
        return {"name": spec.get("name"), "trainable": bool(spec.get("trainable")),
                "task": spec.get("task", "causal-lm"), "shared": bool(spec.get("shared")),
                "replicated": bool(spec.get("replicated"))}
    text = str(spec)
    low = label.lower()
    lowered = text.lower()
    # Not a model of its own: the policy with LoRA off, precomputed log-probs, or a reward function /
    # environment (PPO's "reward" entry may be `correctness`, `module:function` or `env:math`).
    shared = (text.startswith("precomputed") or any(w in lowered for w in ("lora disabled", "without adapters",
                                                                          "same as"))
              or text.startswith("env:") or text in ("default", "length_penalty", "correctness", "custom")
              or (":" in text and not text.startswith("tiny:") and not Path(text).exists()))
    trainable = "trainable" in low and "frozen" not in low
    # A frozen reward model is scored on every rank without ZeRO sharding (it is not a DeepSpeed engine).
    return {"name": text, "trainable": trainable, "task": "classifier" if ("reward" in low or "value" in low)
            else "causal-lm", "shared": shared, "replicated": "reward" in low and not trainable}


def estimate_memory(cfg, models: dict, world: int, zero: ZeroSettings) -> list[dict]:
    """One row per model: parameters, trainable parameters, GiB per GPU of its model states."""
    p = _dtype_bytes(cfg.dtype)
    lora = cfg.lora.enabled
    four_bit = bool(getattr(cfg, "load_in_4bit", False))
    rows = []
    for label, spec in models.items():
        r = _role(label, spec)
        row = {"model": label, "name": r["name"]}
        if r["shared"]:
            rows.append({**row, "params": 0, "trainable": 0, "gib_per_gpu": 0.0,
                         "note": "no weights of its own"})
            continue
        conf = load_model_config(r["name"], cfg.trust_remote_code) if r["name"] else None
        if conf is None and r["name"] and (r["task"] == "classifier" or _looks_local(r["name"])) \
                and not Path(r["name"]).expanduser().exists():  # a reward model is always a local directory
            rows.append({**row, "params": None, "trainable": None, "gib_per_gpu": None,
                         "note": "not found: an earlier step writes it (e.g. launch/reward.py); not planned"})
            continue
        if conf is None:
            rows.append({**row, "params": None, "trainable": None, "gib_per_gpu": None,
                         "note": "config not found locally: `hf download NAME config.json`, or add it to "
                                 "rl.scripts.common.KNOWN_CONFIGS"})
            continue
        use_lora = lora and r["trainable"]
        pc = count_parameters(conf, r["task"], cfg.lora.rank if use_lora else 0, cfg.lora.target_modules)
        n, note = pc.total, ""
        frozen_p = p
        if four_bit and r["trainable"]:
            # NF4 with double quantisation: ~0.52 bytes per quantised linear weight; the rest stays p.
            frozen_p = (0.52 * pc.linear + p * (n - pc.linear)) / n
            note = "4-bit base"
        if r["trainable"]:
            t = pc.lora if use_lora else n
            if use_lora:
                n += pc.lora
                note = (note + ", " if note else "") + f"LoRA r={cfg.lora.rank}"
            b = trainable_states_bytes(n, pc.largest_layer, world, zero, t, frozen_p,
                                       mixed_precision=cfg.dtype != "float32", optim=cfg.optim)
            if not cfg.optim.startswith("adamw_torch"):
                note = (note + ", " if note else "") + cfg.optim
        else:
            t = 0
            z = ZeroSettings(0, False, False, zero.source) if r["replicated"] else zero
            b = frozen_states_bytes(n, pc.largest_layer, world, z, p)
            note = "replicated on every GPU" if r["replicated"] and zero.stage == 3 else note
        rows.append({**row, "params": n, "trainable": t, "gib_per_gpu": round(b / 2**30, 3), "note": note})
    return rows


def format_memory_table(rows: list[dict]) -> str:
    lines = [f"{'model':<28} {'params':>10} {'trainable':>10} {'GiB/GPU':>8}  name"]
    for r in rows:
        n = "?" if r["params"] is None else f"{r['params'] / 1e6:.1f}M"
        t = "?" if r["trainable"] is None else f"{r['trainable'] / 1e6:.2f}M"
        g = "?" if r["gib_per_gpu"] is None else f"{r['gib_per_gpu']:.2f}"
        extra = f"  ({r['note']})" if r.get("note") else ""
        lines.append(f"{r['model']:<28} {n:>10} {t:>10} {g:>8}  {r['name']}{extra}")
    total = sum(r["gib_per_gpu"] or 0 for r in rows)
    unplanned = sum(r["gib_per_gpu"] is None for r in rows)
    gap = f"; {unplanned} model(s) marked ? not counted" if unplanned else ""
    lines.append(f"{'total model states':<28} {'':>10} {'':>10} {total:>8.2f}  (activations and KV cache on top{gap})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the data

def missing_data(data) -> str | None:
    """What of the recipe's data a dry run cannot read here, in words, or None when all of it is local.

    A plan needs the model's config, not the data: a dry run reads local files and folders (to count the
    examples) but never fetches a Hub dataset, and a file that is not here yet is no error."""
    if not has_data(data):
        return "data.path is not set"
    sources = [data.path] if data.path is not None else [m.get("path") for m in data.mixture]
    sources += [data.eval_path] if getattr(data, "eval_path", None) else []
    for src in sources:
        if src is not None and Path(str(src)).expanduser().exists():
            continue
        if src is not None and HUB_ID.fullmatch(str(src)) and not str(src).lower().endswith(SUFFIXES) \
                and not Path(str(src).split("/")[0]).is_dir():
            return f"{src} is a Hub dataset (a dry run fetches no data)"
        return f"{src} not found"
    return None


def dry_run_data(cfg, load):
    """`load(cfg)` for a --dry-run when its data is here; otherwise None, after one line saying what
    could not be counted without it. A trainer whose environment supplies the prompts (env_type, no
    data.path) loads nothing and is planned in full."""
    missing = missing_data(cfg.data)
    if missing is None or (not has_data(cfg.data) and getattr(cfg, "env_type", None)):
        return load(cfg)
    print(f"data: {missing} — examples, steps per epoch and token counts not planned")
    return None


# ------------------------------------------------------------------------------------- the report

def dry_run_report(cfg, n_examples: int | None = None, models: dict | None = None,
                   extra: dict | None = None, prompt_group: int | None = None) -> dict:
    """Print the resolved config, the derived sizes and the memory estimate; builds no real model.

    `models` maps a label to a model name (or a dict with name/trainable/task/shared): "policy
    (trainable)", "reference (frozen)", "value (trainable)", "reward model (frozen)". The world size is
    WORLD_SIZE (set by `accelerate launch`; set it by hand to plan for N GPUs without them). `extra`
    holds a trainer's own derived sizes (PPO's rollout and minibatch sizes, ...), printed in the plan.
    `prompt_group`: the trainer draws whole steps of distinct prompts (GRPO: its num_generations, online DPO
    and distillation: 1), so steps per epoch are floor(n / prompts per step) and data with fewer than one
    step's prompts is the launch's own refusal (a ConfigError), not a plan of 0 steps."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = cfg.per_device_train_batch_size
    global_batch = per_device * cfg.gradient_accumulation_steps * world
    zero = zero_settings(cfg.deepspeed)
    info = {
        "world_size": world,
        "per_device_batch": per_device,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "global_batch": global_batch,
        "deepspeed": zero.source,
        "zero_stage": zero.stage,
        "offload": {"optimizer": zero.offload_optimizer, "param": zero.offload_param},
    }
    if n_examples is not None:
        info["examples"] = n_examples
        info["steps_per_epoch"] = -(-n_examples // global_batch)  # a short last step counts (rl.config.fields.epoch_plan)
        if prompt_group is not None:
            problem = prompts_step_problem(cfg, n_examples, world, prompt_group)
            if problem:
                raise ConfigError(problem)
            info["steps_per_epoch"] = n_examples // (per_device * cfg.gradient_accumulation_steps // prompt_group * world)
    info.update(extra or {})
    policy = next(iter(models.values()), None) if models else None
    conf = load_model_config(policy, cfg.trust_remote_code) if isinstance(policy, str) else None
    if conf is not None and hasattr(cfg, "max_length"):  # the launch's refusal (rl.models.limits), from the config
        check_length(cfg.max_length, conf, policy)
    if models:
        info["models"] = {k: (v if isinstance(v, str) else v.get("name")) for k, v in models.items()}
        info["memory_per_gpu"] = estimate_memory(cfg, models, world, zero)
    if getattr(cfg, "push_to_hub", False):  # where it would upload, without asking the hub anything
        info["push_to_hub"] = hub_plan(cfg)
    print(yaml.safe_dump({"config": to_dict(cfg), "plan": info}, sort_keys=False))
    if getattr(cfg, "push_to_hub", False):
        hub = info["push_to_hub"]
        print(f"push_to_hub: would upload {hub['uploads']} to {hub['repository']} (branch {hub['branch']}; "
              f"hub_strategy {hub['hub_strategy']}); nothing was sent")
    if models:
        print(f"estimated GPU memory of model states, {world} GPU(s), ZeRO stage {zero.stage}"
              f"{' + optimizer offload' if zero.offload_optimizer else ''}"
              f"{' + param offload' if zero.offload_param else ''}:")
        print(format_memory_table(info["memory_per_gpu"]))
    return info
