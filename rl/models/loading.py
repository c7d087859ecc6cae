"""Loading models and tokenizers: dtype, LoRA, 4-bit/8-bit quantisation, attention kernel, gradient
checkpointing, frozen copies.

Every trainer loads through here so that `tiny:<family>` names, GGUF files and packaged names
(rl.models.sources), `trust_remote_code` (off unless the user asks), attention kernels and LoRA targets
behave the same everywhere. `load_causal_lm` also loads a sequence classifier (`task='classifier'`, how
reward models start from a causal LM) and a LoRA run's output directory (its base with the adapter
merged, so one stage's output is the next stage's `model_name`); a model that cannot be found or read
is one `ConfigError` line (`not_loadable`). `resolve_dtype('auto')` is bf16 on a CUDA GPU that has it,
else fp32; trainable policies keep fp32 master weights (`load_trainable_policy`). `apply_lora` targets
every linear layer but the output head by default ('all-linear'), GPT-2's Conv1D included.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import torch
from safetensors import safe_open

from rl.config.vocabulary import note_ignored
from rl.errors import ConfigError, disk_full, first_line
from rl.models.saving import adapter_base
from rl.models.sources import resolve_model_path
from rl.models.tiny import without_zero3_init


def resolve_dtype(name: str | None) -> torch.dtype:
    """'auto' -> bfloat16 on a CUDA GPU that supports it, else float32 (CPU bf16 is slow here)."""
    if name in (None, "auto"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[name]


def usable_attention(name: str) -> str:
    """`name`, or sdpa (the same attention, another kernel) when it is flash attention and this machine cannot run
    it (no CUDA GPU, or no flash-attn package): a recipe written for GPUs runs here, saying so in one line."""
    if not name.startswith("flash_attention"):
        return name
    package = "flash_attn_interface" if name == "flash_attention_3" else "flash_attn"
    if torch.cuda.is_available() and importlib.util.find_spec(package) is not None:
        return name
    note_ignored("attn_implementation", f"{name} needs a CUDA GPU and the {package} package; sdpa is used, the "
                                        f"same attention")
    return "sdpa"


def not_loadable(name: str, what: str, error: Exception) -> ConfigError:
    """One line for a model/tokenizer the loader could not find or read (a hub id offline, a typo)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if disk_full(error):  # writing a tiny model or a GGUF conversion into its cache, before the run
        return ConfigError(f"model {name!r}: no space left on device while preparing it in its cache ({first}); "
                           f"free space, or point RL_TINY_CACHE / RL_MODEL_CACHE / HF_HOME at a disk that has some")
    return ConfigError(f"model {name!r}: cannot load its {what} ({first}); check the name, or download it "
                       f"first (hf download {name}) when this machine is offline")


def bad_safetensors(directory: str | Path) -> tuple[Path, str] | None:
    """The first `*.safetensors` file in `directory` whose header or size is unreadable (a truncated file
    fails here too: its header no longer covers the file), with the reader's complaint; no tensor is read."""
    for f in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                st.keys()
        except Exception as e:  # noqa: BLE001 - the library's own errors are several types; its message says which
            return f, first_line(e, 120)
    return None


def unreadable(name: str, error: Exception, path: str | Path | None = None) -> ConfigError | None:
    """One line for weights that were refused or cannot be read, or None for another error: a truncated or
    corrupt safetensors file (named: the first bad one in the model directory `path`; safetensors' own
    message names no file), or a pickle (`.bin`) that `weights_only` loading refused (a pickle can run
    code; nothing of it ran)."""
    kind = type(error).__name__
    first = (str(error).strip().splitlines() or [kind])[0][:200]
    if kind == "SafetensorError" or "safetensors" in type(error).__module__:
        found = bad_safetensors(path) if path is not None and Path(path).is_dir() else None
        what, first = (f"{found[0]} cannot be read", found[1]) if found else ("a safetensors file cannot be read",
                                                                             first)
        return ConfigError(f"model {name!r}: {what} ({first}); it is truncated or corrupt: copy or download it again")
    if isinstance(error, pickle.UnpicklingError) or "weights_only" in str(error):
        return ConfigError(f"model {name!r}: refused to unpickle its weights (a pickled .bin file can run code; "
                           f"nothing of it ran): save them as safetensors (save_pretrained(..., "
                           f"safe_serialization=True)) and load that")
    return None


def check_source(name: str, path: str, task: str = "causal-lm") -> None:
    """One ConfigError before loading when `name` cannot be what is asked: a local path that does not
    exist (transformers would call it an invalid hub id), or a reward model where a causal LM is wanted."""
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith("/")
    p = Path(path).expanduser()
    if looks_local and not p.exists():
        raise ConfigError(f"model {name!r}: no such file or directory; give a run's output directory, a model "
                          f"directory, a .gguf file or a hub id")
    if p.is_file() and p.suffix.lower() != ".gguf":  # transformers would take it for a hub id to download
        parent = f" (its folder {p.parent} is one: give that)" if (p.parent / "config.json").is_file() else ""
        raise ConfigError(f"model {name!r} is a file, not a model directory{parent}; give a directory holding "
                          f"config.json (a run's output_dir), a .gguf file, a hub id or tiny:<family>")
    if task == "classifier" or not p.is_dir():
        return
    arch = []
    try:
        arch = json.loads((p / "config.json").read_text()).get("architectures") or [] \
            if (p / "config.json").is_file() else []
    except (ValueError, OSError):
        pass
    if (p / "reward_config.json").is_file() or any(str(a).endswith("ForSequenceClassification") for a in arch):
        raise ConfigError(f"model {name!r} is a reward model (a classifier, as launch/reward.py writes it), not a "
                          f"causal LM: it scores text, it does not generate; use it as reward_model_path, and give "
                          f"a policy's output directory here")


def load_tokenizer(name: str, trust_remote_code: bool = False, padding_side: str = "right", revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code,
                                            **({"revision": revision} if revision else {}))
    except OSError as e:  # transformers' "not a valid model identifier / no such file" family
        raise not_loadable(name, "tokenizer", e) from None
    if tok.pad_token is None:
        # Many causal LMs ship without a pad token; reuse EOS (masked out everywhere we pad).
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def vocabulary_mismatch(tokenizer, other, whose: str = "the student's") -> str | None:
    """Why two tokenizers do not share one vocabulary (None when they do): the first id both define that
    they map to different tokens. Ids only one of them defines (a special token a tokenizer class adds on
    load, as Qwen2's does) do not count: the models' output sizes are compared where both are loaded."""
    mine = {i: t for t, i in tokenizer.get_vocab().items()}
    theirs = {i: t for t, i in other.get_vocab().items()}
    differ = sorted(i for i in mine.keys() & theirs.keys() if mine[i] != theirs[i])
    if not differ:
        return None
    i = differ[0]
    return (f"maps id {i} to {theirs[i]!r} where {whose} tokenizer has {mine[i]!r} ({len(differ)} of "
            f"{len(mine.keys() & theirs.keys())} shared ids differ)")


def load_causal_lm(name: str, dtype: str | torch.dtype | None = "auto", trust_remote_code: bool = False,
                   attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                   quantization: str | None = None, task: str = "causal-lm", num_labels: int = 1,
                   revision: str | None = None, bnb: dict | None = None, init_kwargs: dict | None = None,
                   checkpointing_kwargs: dict | None = None):
    """Load a causal LM (or, with task='classifier', a sequence classifier) by id, path or tiny:name.

    `quantization` = '4bit' | '8bit' loads the weights through bitsandbytes (QLoRA), with `bnb` TRL's 4-bit
    options (`quantization_options`; None: NF4 with nested quantization). `revision` is the hub revision (TRL's
    model_revision), `init_kwargs` more keywords of from_pretrained (TRL's model_init_kwargs). A PEFT adapter
    directory (a LoRA run's output) loads as its base model with the adapter merged, so one stage's
    output is the next stage's `model_name` whether or not it trained LoRA."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    # A causal-LM checkpoint loads as a classifier too (new score head): how reward models start.
    path = resolve_model_path(name)
    check_source(name, path, task)
    base = adapter_base(path)
    if base is not None:  # a LoRA run's output: its base with the adapter merged in, a plain model again
        from peft import PeftModel

        # Merged on whole tensors: under a ZeRO-3 launch, zero.Init would leave each process a shard to
        # merge into; DeepSpeed partitions the merged model when the engine is built instead.
        with without_zero3_init():
            model = load_causal_lm(base, dtype, trust_remote_code, attn_implementation, gradient_checkpointing,
                                   quantization, task, num_labels, bnb=bnb, init_kwargs=init_kwargs,
                                   checkpointing_kwargs=checkpointing_kwargs)
            try:
                model = PeftModel.from_pretrained(model, path).merge_and_unload()
            except Exception as e:  # noqa: BLE001 - refused or unreadable adapter weights: one line
                raise (unreadable(name, e, path) or e) from None
        # named after the adapter, so that a LoRA run on top records this directory as its base
        # (adapter_config.json's base_model_name_or_path), not the model under it
        model.name_or_path = model.config._name_or_path = str(path)
        return model
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    kwargs = {k: v for k, v in (init_kwargs or {}).items() if k not in ("dtype", "torch_dtype")}
    kwargs.update(dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = usable_attention(attn_implementation)
    if revision:
        kwargs["revision"] = revision
    if quantization in ("4bit", "8bit"):
        from transformers import BitsAndBytesConfig

        o = {"quant_type": "nf4", "nested": True, "storage": None, **(bnb or {})}
        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=o["quant_type"], bnb_4bit_compute_dtype=torch_dtype,
                               bnb_4bit_use_double_quant=o["nested"], bnb_4bit_quant_storage=o["storage"] or "uint8")
            if quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    try:
        if task == "classifier":
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise (unreadable(name, e, path) or not_loadable(name, "weights", e)) from None
    except Exception as e:  # noqa: BLE001 - safetensors' own error, a refused pickle: one line; else re-raised
        raise (unreadable(name, e, path) or e) from None
    if task == "classifier" and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    if gradient_checkpointing:
        enable_checkpointing(model, checkpointing_kwargs)
        model.config.use_cache = False
    return model


def enable_checkpointing(model, kwargs: dict | None = None) -> None:
    """Activation (gradient) checkpointing, non-reentrant unless `kwargs` (TRL's gradient_checkpointing_kwargs)
    say otherwise, by this transformers' name for it: 5.2x renamed `gradient_checkpointing_enable` to
    `activation_checkpointing_enable` and warns on the old one."""
    kwargs = {"use_reentrant": False, **(kwargs or {})}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def quantization_options(cfg) -> dict:
    """`load_causal_lm`'s quantization keywords of a config (TRL's ModelConfig 4-bit keys): quantization '4bit',
    '8bit' or None, and the 4-bit options."""
    quantization = "4bit" if getattr(cfg, "load_in_4bit", False) else "8bit" if getattr(cfg, "load_in_8bit", False) \
        else None
    bnb = {"quant_type": cfg.bnb_4bit_quant_type, "nested": cfg.use_bnb_nested_quant,
           "storage": cfg.bnb_4bit_quant_storage} if quantization else None
    return {"quantization": quantization, "bnb": bnb}


def load_trainable_policy(cfg):
    """The policy a trainer optimises, from a TrainConfig: fp32 master weights (bf16 compute comes
    from autocast / DeepSpeed), the recipe's attention kernel, revision, from_pretrained keywords, 4-bit/8-bit
    frozen weights (QLoRA), gradient checkpointing and dropout."""
    model = load_causal_lm(cfg.model_name, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                           attn_implementation=cfg.attn_implementation,
                           gradient_checkpointing=cfg.gradient_checkpointing, revision=cfg.model_revision,
                           init_kwargs=cfg.model_init_kwargs, checkpointing_kwargs=cfg.gradient_checkpointing_kwargs,
                           **quantization_options(cfg))
    if cfg.disable_dropout:
        disable_dropout(model)
    return model


def seed_run(cfg) -> None:
    """Seed a run (`seed`); with full_determinism also transformers' deterministic kernels (TRL's meaning)."""
    if getattr(cfg, "full_determinism", False):
        from transformers import enable_full_determinism

        enable_full_determinism(cfg.seed)
    torch.manual_seed(cfg.seed)


def add_neftune(model, alpha: float | None) -> None:
    """NEFTune (Jain et al. 2023; transformers' neftune_noise_alpha): in training forwards, the input embeddings plus
    uniform noise in [-s, s], s = alpha / sqrt(sequence length x hidden size). None: nothing."""
    if not alpha:
        return

    def hook(module, args, output):
        if module.training:
            scale = alpha / (output.size(1) * output.size(2)) ** 0.5
            output = output + torch.zeros_like(output).uniform_(-scale, scale)
        return output

    model.get_input_embeddings().register_forward_hook(hook)


def disable_dropout(model) -> None:
    """Every dropout of `model` set to 0 (TRL's disable_dropout: log-probs of the same weights agree)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def configure_tokenizer(tok, cfg):
    """A config's tokenizer keys applied to `tok` (TRL's): chat_template_path (a .jinja file, or a tokenizer
    directory or hub id whose template to use), eos_token, pad_token. Returns `tok`."""
    path = getattr(cfg, "chat_template_path", None)
    if path:
        p = Path(path)
        if p.is_file():
            tok.chat_template = p.read_text()
        else:
            tok.chat_template = load_tokenizer(path, cfg.trust_remote_code).chat_template
    for key in ("eos_token", "pad_token"):
        value = getattr(cfg, key, None)
        if value:
            if value not in tok.get_vocab():
                raise ConfigError(f"key '{key}': {value!r} is not a token of {cfg.model_name}'s tokenizer")
            setattr(tok, key, value)
    return tok


def apply_lora(model, rank: int = 16, alpha: int = 32, dropout: float = 0.05,
               target_modules: str | list[str] | None = "all-linear", task_type: str = "CAUSAL_LM",
               modules_to_save: list[str] | None = None, target_parameters: list[str] | None = None,
               use_rslora: bool = False, use_dora: bool = False):
    """Wrap `model` with LoRA adapters. 'all-linear' adapts every linear layer but the output head,
    so GPT-2 (Conv1D c_attn), Llama, Qwen2 and Gemma all work without naming their modules; None is peft's
    default for the architecture (TRL's lora_target_modules: null)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = [m.strip() for m in target_modules.split(",") if m.strip()]
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                     task_type=task_type, modules_to_save=modules_to_save, target_parameters=target_parameters,
                     use_rslora=use_rslora, use_dora=use_dora)
    return get_peft_model(model, cfg)


def lora_options(lora) -> dict:
    """`apply_lora`'s keywords of a config's `lora` section."""
    return dict(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules,
                modules_to_save=lora.modules_to_save, target_parameters=lora.target_parameters,
                use_rslora=lora.use_rslora, use_dora=lora.use_dora)


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


def release_device_cache() -> None:
    """Hand the accelerator's cached, unused memory back (`optimize_device_cache`): generation's KV cache
    and training's activations then do not both sit in the allocator's cache. Costs a little speed; a
    no-op on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
