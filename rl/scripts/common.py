"""What every launch script shares before and around training: one-line failures (`fail`, `run_training`:
exit 2 for a mistake in the input, 1 for a failure during the run, 128 + signal after a stop's checkpoint),
and the preflight of a recipe (`preflight`: model names, the DeepSpeed file, the resume path and
output_dir checked before any model is built, so a typo fails in a second)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

from rl.config.parse import cli_config
from rl.data.records import has_data
from rl.engine.optim import bitsandbytes_problem, optim_problem
from rl.engine.tracking import quiet_third_party
from rl.errors import ConfigError, DataError, RunError, disk_full, first_line
from rl.models.loading import bad_safetensors
from rl.models.reward_format import reward_model_problem
from rl.models.sources import TINY_PREFIX
from rl.models.tiny import FAMILIES

_VERBOSE = False  # `verbose: true` in the recipe (set by preflight): the error line comes with its traceback


def fail(message: str, code: int = 2):
    """Print one `error:` line (no traceback, unless the recipe says `verbose: true`) and exit: for mistakes in
    the user's input (2) and failures the user can act on (1)."""
    if _VERBOSE and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_training(trainer, train, *args, **kwargs):
    """`train(*args, **kwargs)` for a launch script: a failure the user can act on (a diverged run, a full
    disk, an unreadable checkpoint, a mistake found only now) is one `error:` line and exit 1 (2 for
    input mistakes); a stop on a signal exits 128 + signal after its checkpoint, so that a scheduler
    tells it from success. Returns the history otherwise."""
    try:
        history = train(*args, **kwargs)
    except (ConfigError, DataError, FileNotFoundError) as e:
        fail(str(e))
    except RunError as e:
        fail(str(e), code=1)
    except Exception as e:  # a full disk in a write of the run's own (metrics.jsonl, a plot): one line too
        if not disk_full(e):
            raise
        out = getattr(getattr(trainer, "cfg", None), "output_dir", "the output directory")
        fail(f"no space left on {out} during training ({first_line(e)}); free space, then rerun with "
             f"resume=auto to continue from the newest checkpoint", code=1)
    if getattr(trainer, "stopped_by", None):
        raise SystemExit(128 + int(trainer.stopped_by))
    return history


@contextmanager
def final_save(output_dir):
    """Step 4 of a launch script, writing the final model (and its card) into `output_dir`: a full disk is
    one `error:` line and exit 1, as it is for a checkpoint, instead of the writer's traceback. The
    checkpoints are untouched, so a rerun with resume=auto trains what is left and writes the model again."""
    try:
        yield
    except RunError as e:
        fail(str(e), code=1)
    except Exception as e:
        if not disk_full(e):
            raise
        fail(f"no space left on {output_dir} while writing the final model ({first_line(e)}); its files there "
             f"are incomplete: free space, then rerun with resume=auto (it continues from the newest checkpoint "
             f"and saves again)", code=1)


# ------------------------------------------------------------------------------------ preflight

# config keys that name a model: (key, what it must be). "reward" must score (a classifier).
MODEL_KEYS = (("model_name", "model"), ("ref_model", "model"),
              ("teacher_model_name", "model"), ("critic_model_path", "model"), ("reward_model_path", "reward"))


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub id ('gpt2', 'org/name'): absolute, ./ ~/, more than one '/', or a
    first component that exists here (runs/rm when runs/ exists)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith("/"):
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()


def model_problem(key: str, name: str, role: str = "model") -> str | None:
    """Why `name` (the value of config key `key`) cannot be loaded, without loading it; None when it
    looks fine or is a hub id left to the loader (offline, which then fails with one line of its own)."""
    if name.startswith(TINY_PREFIX):
        family, *options = name[len(TINY_PREFIX):].split("-")
        if family not in FAMILIES or not set(options) <= {"classifier", "hd64"}:
            return (f"key '{key}': unknown tiny model {name!r}; use tiny:<family>, tiny:<family>-classifier or "
                    f"tiny:<family>-hd64 (head_dim 64, for vLLM) with family one of {', '.join(FAMILIES)}")
        if role == "reward" and "classifier" not in options:
            return (f"key '{key}': {name!r} is a causal LM, not a reward model; train one with launch/reward.py "
                    f"or use tiny:{family}-classifier")
        return None
    path = Path(name).expanduser()
    if not path.exists():
        if role == "reward":  # load_reward_model reads a local directory only
            return f"key '{key}': {name} does not exist; give the directory written by launch/reward.py"
        if _looks_like_path(name):
            return f"key '{key}': {name} does not exist; give an existing model directory or a hub id"
        return None
    if path.suffix.lower() == ".gguf" and path.is_file() and role != "reward":
        return None  # a GGUF file is converted on first use (rl.models.gguf)
    if not path.is_dir():
        return f"key '{key}': {name} is a file; give the model's directory (with config.json) or a .gguf file"
    if role == "reward":
        problem = reward_model_problem(path)
        if problem:
            return f"key '{key}': {problem}"
    elif not (path / "config.json").exists() and not (path / "adapter_config.json").exists() and \
            not any(path.glob("*.gguf")):  # a directory holding one GGUF file is converted on first use
        return (f"key '{key}': {name} has no config.json (nor adapter_config.json), so it is not a model directory (a finished run "
                f"writes its model to output_dir; a checkpoint goes to resume=, not model_name)")
    return safetensors_problem(key, path)


def safetensors_problem(key: str, directory: Path) -> str | None:
    """The first *.safetensors file in `directory` whose header or size is unreadable (no tensor is read)."""
    found = bad_safetensors(directory)
    if found is None:
        return None
    return f"key '{key}': {found[0]} is not a readable safetensors file ({found[1]}); re-save or re-download the model"


def writable_problem(key: str, directory: str) -> str | None:
    """Why `directory` cannot be created or written (its nearest existing ancestor decides)."""
    p = Path(directory).expanduser().absolute()
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"key '{key}': {probe} is a file, so {directory} cannot be a directory; choose another output_dir"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"key '{key}': {probe} is not writable; choose another output_dir or fix its permissions"
    return None


def preflight_problems(cfg) -> list[str]:
    """Every mistake in `cfg` found without building a model: model names, the deepspeed file, whether
    bitsandbytes loads for its 8-bit optimizers, the resume path and output_dir. Keys a config lacks are
    skipped."""
    problems = []
    planning = bool(getattr(cfg, "dry_run", False))
    for key, role in MODEL_KEYS:
        name = getattr(cfg, key, None)
        if isinstance(name, str) and name:
            if planning and not Path(name).expanduser().exists() and (role == "reward" or _looks_like_path(name)):
                continue  # an earlier step's output (a reward model): the dry run says it is not planned
            problems.append(model_problem(key, name, role))
    ds = getattr(cfg, "deepspeed", None)
    if ds:
        if not Path(ds).is_file():
            problems.append(f"key 'deepspeed': {ds} does not exist; give a DeepSpeed JSON file such as "
                            f"ds_configs/zero3.json")
        else:
            try:
                json.loads(Path(ds).read_text())
            except (ValueError, UnicodeDecodeError) as e:
                problems.append(f"key 'deepspeed': {ds} is not valid JSON ({e})")
    if not planning:  # like report_to's packages (rl.config.schema): a missing library fails before the run
        problems.append(optim_problem(getattr(cfg, "optim", None)))
        for key in ("load_in_4bit", "load_in_8bit"):  # the reward model's QLoRA backbone
            if getattr(cfg, key, False) is True:
                problems.append(bitsandbytes_problem(key, "true", f"{key}=false"))
    resume = getattr(cfg, "resume", None)
    if resume and resume != "auto" and not Path(resume).exists():
        problems.append(f"key 'resume': {resume} does not exist; give a checkpoint directory "
                        f"(output_dir/checkpoints/checkpoint-N) or resume=auto")
    out = getattr(cfg, "output_dir", None)
    if out and not getattr(cfg, "dry_run", False):
        problems.append(writable_problem("output_dir", out))
    return [p for p in problems if p]


def preflight(cfg) -> None:
    """`preflight_problems` for a launch script, right after parsing: the first problem is one
    `error:` line and exit 2, before any model is built. Also hides third-party noise unless
    `verbose: true` (`rl.engine.tracking.quiet_third_party`)."""
    global _VERBOSE
    _VERBOSE = bool(getattr(cfg, "verbose", False))
    quiet_third_party(_VERBOSE)  # first: before the libraries load
    problems = preflight_problems(cfg)
    if problems:
        fail(problems[0])


NO_DATA_ERROR = ("data.path is not set: pass --data.path FILE.jsonl or set data: {path: ...} (or data.mixture) "
                 "in the recipe")


def parse_recipe(cls, argv, prog: str, description: str, require_data: bool = False):
    """Step 1 of a launch script: the recipe + overrides as `cls`, then `preflight`; with `require_data`
    a missing data.path is one `error:` line and exit 2 as well."""
    cfg = cli_config(cls, argv, prog=prog, description=description)
    preflight(cfg)  # model names, deepspeed file, resume path, output_dir: before any model
    if require_data and not has_data(cfg.data) and not cfg.dry_run:  # a plan needs no data (rl.scripts.dryrun)
        fail(NO_DATA_ERROR)
    return cfg


# ------------------------------------------------------------------------------ model configs

# config.json fields (the ones that decide the parameter count, and the context that rl.models.limits checks
# max_length against) of the real models our recipes name, so that a dry run works offline. Instruct/-it variants share the base model's architecture.
KNOWN_CONFIGS: dict[str, dict] = {
    "gemma-3-270m": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                         num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "gemma-2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False, max_position_embeddings=32768),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=8192),  # also the packaged name smollm2-135m-instruct (rl.models.gguf)
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False, max_position_embeddings=131072),
}
