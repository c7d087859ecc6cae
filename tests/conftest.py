"""Shared fixtures: tiny offline models built once per test session, quiet logs, deterministic seeds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Set before anything imports transformers/wandb: no network, no telemetry, no login prompts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# "It learns" tests take their seed from RL_TEST_SEED (default 0), so that bench/learning_spread.py can
# measure each threshold's margin over seeds, thread counts and CPU kernels; each test reports the
# quantity its threshold bounds through `learned`.
LEARN_SEED = int(os.environ.get("RL_TEST_SEED", "0"))


def learned(name: str, value: float) -> float:
    """Print `learned: <name> <value>` (bench/learning_spread.py reads it with pytest -s) and return value."""
    print(f"\nlearned: {name} {value:.4f}")
    return value


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_worker():
    """Under pytest-xdist (`-n 2`) every worker computes with one intra-op thread: two workers on two cores
    instead of four threads fighting for them (run_cmd gives its subprocesses OMP_NUM_THREADS=1 too)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory):
    """`tiny:<family>` model names resolve into this session's temporary directory."""
    path = tmp_path_factory.mktemp("tiny-cache")
    os.environ["RL_TINY_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_cache):
    from rl.models.tiny import write_tiny_model

    return str(write_tiny_model(tiny_cache / "llama", family="llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama):
    from rl.models.loading import load_tokenizer

    return load_tokenizer(tiny_llama)


def swapped_digits_copy(model_dir, out: Path) -> dict:
    """A copy of a tiny model whose tokenizer maps the ids of '0' and '1' to each other (the same size, another
    vocabulary); returns the copy's vocabulary (token -> id)."""
    import json
    import shutil

    shutil.copytree(model_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return vocab


def run_cmd(args: list[str], timeout: int = 600, env: dict | None = None, cwd: Path = ROOT):
    """Run a command from the repository root; on failure the assertion shows its output tail."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(map(str, args))}\n{tail}")
    return proc


def launch_module(script: str):
    """The code behind launch/<script>.py, imported once per session, so a test can call its `main(argv)` in
    this process and pay the imports once instead of starting a process per run: for a registered trainer
    `rl.scripts.train.main(script, argv)`, for the others (pipeline, eval, chat) their `rl.scripts.<script>`."""
    from rl.trainers.registry import TRAINERS

    if script in TRAINERS:
        from rl.scripts.train import script as trainer_script

        return SimpleNamespace(main=trainer_script(script))
    return importlib.import_module(f"rl.scripts.{script}")


def run_main(script: str, argv: list[str], capfd, monkeypatch) -> tuple[int, str, str]:
    """`python launch/<script>.py *argv` from the repository root, as its `main(argv)` in this process:
    (exit status, stdout, stderr). The exit status and the error lines are the launch script's own; what
    it saves is a process start-up (Python, torch, transformers: several seconds per run on 2 cores).
    A run that must receive a signal, or run under `accelerate launch`, still needs its own process.
    One intra-op thread, as `run_cmd` gives a subprocess (OMP_NUM_THREADS=1): the same numerics, and
    measured on the shared 2-core machine, two threads doubled the CPU time of the real-model runs.
    `capfd` None (a module-scoped fixture): the output is left to pytest's capture, ("", "") returned."""
    import torch

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("RL_NO_PROGRESS", "1")
    if capfd is not None:
        capfd.readouterr()  # only this run's output
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        launch_module(script).main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.set_num_threads(threads)
    stdout, stderr = capfd.readouterr() if capfd is not None else ("", "")
    return code, stdout, stderr


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd(script: str, *script_args: str, num_processes: int = 2, zero3: bool = False,
                   ds_config: str = "ds_configs/zero3.json") -> list[str]:
    """`accelerate launch` with 2 CPU processes: DDP (gloo) or DeepSpeed ZeRO-3, on a free port of its own
    (two such runs at once, one per pytest-xdist worker, must not meet on accelerate's default 29500)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    if zero3:
        base = launch + ["--use_deepspeed", "--deepspeed_config_file", ds_config]
    else:
        # Measured: this env var plus --multi_gpu gives MULTI_CPU with gloo (--cpu conflicts with it).
        base = ["env", "ACCELERATE_USE_CPU=true"] + launch + ["--multi_gpu"]
    return base + [script, *script_args]
