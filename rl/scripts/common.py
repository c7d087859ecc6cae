"""What every launch script shares before and around training: one-line failures (`fail`, `run_training`:
exit 2 for a mistake in the input, 1 for a failure during the run, 128 + signal after a stop's checkpoint),
and the preflight of a recipe (`preflight`: model names, the DeepSpeed file, the resume path and
output_dir checked before any model is built, so a typo fails in a second)."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
import urllib.parse
from contextlib import contextmanager
from pathlib import Path

from rl.config.parse import parse_config
from rl.data.records import has_data
from rl.engine.optim import bitsandbytes_problem, optim_problem
from rl.engine.tracking import quiet_third_party
from rl.errors import ConfigError, DataError, RunError, disk_full, first_line
from rl.models.gguf import PACKAGED
from rl.models.loading import bad_safetensors
from rl.models.reward_format import reward_model_problem
from rl.models.sources import TINY_PREFIX
from rl.models.tiny import FAMILIES

_VERBOSE = False  # `verbose: true` in the recipe (set by preflight): the error line comes with its traceback


def fail(message: str, code: int = 2):
    """Print one `error:` line (no traceback, unless the recipe says `verbose: true`) and exit: for mistakes in
    the user's input (2) and failures the user can act on (1). Under a launcher that prints its own report of a
    failed process after it (`accelerate launch`, torchrun), the line is printed again once the launcher is gone
    (`echo_after_launcher`), so that the last line a user sees is still the cause."""
    if _VERBOSE and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr, flush=True)
    echo_after_launcher(f"error: {message}")
    raise SystemExit(code)


# Waits for the launcher (argv[1]) to exit, then writes argv[2] to stderr and removes the claim file argv[3]. A
# zombie counts as gone: whoever reaps the launcher may be waiting for our end of its output pipe to close.
_ECHO = """import os, sys, time
pid, line, claim = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
end = time.time() + 3600
while alive() and time.time() < end:
    time.sleep(0.05)
sys.stderr.write(line + "\\n")
sys.stderr.flush()
try:
    os.unlink(claim)
except OSError:
    pass
"""


def launcher_pid() -> int | None:
    """The parent process when it is a launcher that reports a failed process with a traceback of its own after
    the process's output: `accelerate launch` (its torchrun agent, or its one-process CalledProcessError) and
    torchrun (`ChildFailedError`, ~35 lines). None otherwise (a plain `python launch/x.py`)."""
    ppid = os.getppid()
    try:
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace")
        argv = [Path(a).name for a in raw.split("\0") if a]
    except OSError:
        return None
    accelerate = ("accelerate" in argv and "launch" in argv) or "accelerate.commands.launch" in argv
    if "TORCHELASTIC_RUN_ID" in os.environ or "torchrun" in argv or "torch.distributed.run" in argv or accelerate:
        return ppid
    return None


def echo_after_launcher(line: str) -> None:
    """Under a launcher (`launcher_pid`), write `line` to stderr again when the launcher has exited, from a
    detached process: torchelastic reports every failed worker with a Python traceback and a box of ~35 lines
    that no exit status of ours avoids (only a signal to the launcher does, and that would report a stop, not
    an error). It writes to the launcher's own stderr: accelerate's one-process launcher reads ours through a
    pipe until every writer is gone. One process per launcher echoes (the first failing rank claims it); the
    launcher's exit status is its own (1)."""
    pid = launcher_pid()
    if pid is None:
        return
    try:  # the launcher's pid and start time name the claim (fields 2 and 22 of /proc/PID/stat)
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        claim = Path(tempfile.gettempdir()) / f"rl-echo-{pid}-{started}"
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except (OSError, IndexError):
        return  # another rank of this launch echoes its line (or the launcher is gone)
    try:  # the launcher's own stderr (appending): ours may be a pipe the launcher reads until every writer is gone
        target = open(f"/proc/{pid}/fd/2", "ab", buffering=0)  # noqa: SIM115 - handed to the child, then closed
    except OSError:  # a socket or a closed stream: no second line
        claim.unlink(missing_ok=True)
        return
    with target:
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _ECHO, str(pid), line, str(claim)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=target, start_new_session=True,
                         close_fds=True)


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


def hub_problem(key: str, name: str) -> str | None:
    """Why a hub id cannot be loaded here, said before any library retries: it is not in the local Hugging Face
    cache and the hub cannot be fetched from (HF_HUB_OFFLINE is set, or its host does not answer in 3 s: without
    network huggingface_hub retried for ~60 s, printing a line per retry, before transformers' error). When the
    hub is unreachable the run goes offline (HF_HUB_OFFLINE=1), so a cached model loads without those retries.
    None for a cached model, a reachable hub, or a name that is not a hub id (a packaged GGUF name)."""
    if name.lower() in PACKAGED or name.startswith(TINY_PREFIX) or Path(name).expanduser().exists():
        return None
    why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") \
        else hub_unreachable()
    if why and os.environ.get("HF_HUB_OFFLINE") is None:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when imported; set below if it already is
        if "huggingface_hub" in sys.modules:
            sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repo id: the loader says so in its own words
        return None
    if why is None or isinstance(cached, str):
        return None
    return (f"key '{key}': {name} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and cannot be "
            f"downloaded ({why}); check the name, or download it where there is network (hf download {name}) and "
            f"copy the cache here, or give a local model directory")


@functools.lru_cache(maxsize=1)
def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub (HF_ENDPOINT's host) cannot be reached from here, or None when it answers or a proxy is set
    (a proxy may reach what a direct connection cannot: left to the loader)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as e:
        return f"{host} cannot be reached: {first_line(e, 80)}"
    return None


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
            problem = model_problem(key, name, role)
            problems.append(problem or (hub_problem(key, name) if not planning and role == "model" else None))
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


def parse_cli(cls, argv, prog: str, description: str = ""):
    """The recipe + overrides as `cls` (rl.config.parse.parse_config); a mistake is one `error:` line (`fail`)."""
    try:
        return parse_config(cls, argv, prog, description)
    except ConfigError as e:
        fail(str(e))


def parse_recipe(cls, argv, prog: str, description: str, require_data: bool = False):
    """Step 1 of a launch script: the recipe + overrides as `cls`, then `preflight`; with `require_data`
    a missing data.path is one `error:` line and exit 2 as well."""
    cfg = parse_cli(cls, argv, prog, description)
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
