"""Accelerate and DeepSpeed plumbing shared by the engine and the trainers.

* `build_accelerator`: an Accelerator that works the same on CPU (gloo) and GPU, with or without
  DeepSpeed; its DeepSpeed config gets our accumulation steps, micro- and global batch size
  (`fit_deepspeed_batch`, also for an Accelerator built elsewhere) and gradient clipping.
  DeepSpeed without a launcher is a 1-process world (`_single_process_env`); RL_DIST_TIMEOUT bounds the wait
  for the other processes (`dist_timeout`), a join that times out is one RunError line.
* `is_deepspeed`, `zero_stage`; `inner_optimizer` (the torch optimizer inside accelerate's wrapper)
  and `unwrap_module` (the HF module inside DDP / a DeepSpeed engine).
* `finish_partial_accumulation`: the mean gradient of k < N accumulated micro-batches, averaged across
  DDP processes by hand because the k-th backward ran in `no_sync`.
* `place_frozen` and `reference_ds_config`: a frozen model (a reference) where the policy runs; under
  ZeRO-3 its own DeepSpeed inference engine, so each rank holds a shard of it, like the policy.
* `run_as_program` / `end_program`: a launch script's `main`, and the process's end without the interpreter's
  teardown where torch.distributed ran (gloo's threads outlive the process group).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from rl.engine import host_memory
from rl.errors import ConfigError, RunError

# the variables torch.distributed's env:// init reads; `accelerate launch` (torchrun) sets them all
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _close_process_group() -> None:
    """At exit, after the run's last collective: close torch.distributed's process group ourselves. Left to
    the interpreter's teardown, a rank of a 2-process CPU run was seen to abort after saving ("terminate
    called without an active exception", exit -6) while gloo's threads were still being destroyed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to close cleanly
            pass


def run_as_program(main: Callable, *args) -> NoReturn:
    """`main(*args)` as a launched program (launch/<name>.py), then `end_program` with main's exit status
    (SystemExit's code, 0 when it returns); any other exception keeps Python's own path (traceback, status 1)."""
    try:
        main(*args)
        code = 0
    except SystemExit as e:
        code = e.code
    end_program(code)


def end_program(code: int | str | None = 0) -> NoReturn:
    """End this process with `code` as `sys.exit(code)` would. Where torch.distributed ran, the end is
    `os._exit` once everything a normal exit finishes is finished: the process group closed (after a barrier),
    other non-daemon threads joined, the atexit hooks run, stdout and stderr flushed. What it skips is the
    interpreter's teardown of C++ objects: gloo's worker threads outlive destroy_process_group
    (docs/operations.md) holding tensors, and a rank that tears them down can abort after a finished, saved run
    ("terminate called without an active exception", exit -6; seen in a clean-clone CI run on the 2-node SFT
    test, and once before on ZeRO-3 PPO), which fails the job. A script of one's own under `accelerate launch`
    calls it last."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise SystemExit(code)
    if code is not None and not isinstance(code, int):  # SystemExit("text"): the text on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    _close_process_group()
    for thread in threading.enumerate():  # what the interpreter's exit waits for first
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - the hooks a normal exit runs (trackers, engines); no public name
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to write to
            pass
    os._exit(code or 0)


def _skip_cpu_shm_op() -> None:
    """DeepSpeed on CPU JIT-compiles a shared-memory all-reduce (`deepspeed_shm_comm`) when it starts its
    communication backend: ~1 minute of one core the first time per install (measured 2026-12-02; the build is
    cached per site-packages path, so every fresh environment pays it) and a ninja check in every process.
    Only `inference_all_reduce`, which DeepSpeed's tensor-parallel inference layers call, uses it; training's
    collectives are torch.distributed's (gloo here). Marking the op incompatible makes DeepSpeed skip the
    build, as on a platform without it. RL_DEEPSPEED_SHM=1 keeps DeepSpeed's default."""
    if os.environ.get("RL_DEEPSPEED_SHM") == "1":
        return
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except Exception:  # noqa: BLE001 - another DeepSpeed layout: its default stands
        pass


def _single_process_env() -> None:
    """A DeepSpeed run started with plain `python` (no launcher): the environment of a 1-process world, as
    `accelerate launch --num_processes 1` would set it. Without it DeepSpeed's init_distributed falls back to
    MPI discovery and ends in "No module named 'mpi4py'" (measured); HF's Trainer users expect
    `python train.py --deepspeed ds.json` to run on one device. A free loopback port, so that two such runs
    on one machine do not collide."""
    if all(k in os.environ for k in LAUNCHER_ENV):
        return
    if any(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return  # a launcher's partial environment: its own error is the honest one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    os.environ[ONE_PROCESS_MARK] = f"{os.getpid()}:{os.environ['MASTER_PORT']}"


# Set beside that environment: the process it was made for. A child started from such a process (a launch
# script run by a test that ran a DeepSpeed run in-process, a subprocess of a run) inherits RANK, WORLD_SIZE
# and MASTER_PORT, and without this would join its parent's 1-process world: seen as EADDRINUSE on that port.
ONE_PROCESS_MARK = "RL_ONE_PROCESS_WORLD"


def _drop_inherited_world() -> None:
    """Forget a 1-process world environment made for another process (`ONE_PROCESS_MARK`); a launcher that
    set its own world since (another MASTER_PORT, or more processes) is left alone."""
    pid, _, port = os.environ.get(ONE_PROCESS_MARK, "").partition(":")
    if not pid or pid == str(os.getpid()):
        return
    if os.environ.get("MASTER_PORT") == port and os.environ.get("WORLD_SIZE", "1") == "1":
        for key in (*LAUNCHER_ENV, "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
    os.environ.pop(ONE_PROCESS_MARK, None)


def dist_timeout() -> datetime.timedelta | None:
    """RL_DIST_TIMEOUT (seconds): how long a process waits for the others to form the process group (and,
    torch's one knob for both, for any later collective); unset: torch's default (30 minutes). A machine
    that never joins then ends the run with one line after that long instead of waiting."""
    raw = os.environ.get("RL_DIST_TIMEOUT")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"RL_DIST_TIMEOUT={raw!r} must be a positive number of seconds; unset it for torch's "
                          f"default (1800)")
    return datetime.timedelta(seconds=seconds)


def _is_join_timeout(e: BaseException) -> bool:
    """torch's error when the other ranks did not reach the store in time (DistStoreError, or a
    RuntimeError from gloo's connect, depending on where the wait was)."""
    text = f"{type(e).__name__}: {e}".lower()
    return "timeout" in text or "timed out" in text


def build_accelerator(gradient_accumulation_steps: int = 1, device: str | None = None,
                      micro_batch_size: int | None = None, max_grad_norm: float | None = None,
                      mixed_precision: str | None = None, deepspeed_config: str | None = None):
    """An Accelerator that works the same on CPU (gloo) and GPU, with or without DeepSpeed.

    * On CPU, torch.distributed needs the gloo backend, or accelerate silently falls back to one
      process (measured: `num_processes == 1` under a 2-process launch without it); DeepSpeed's CPU
      shared-memory all-reduce, which training never calls, is not compiled (`_skip_cpu_shm_op`).
    * `deepspeed_config` lets a recipe name its ds_config when `accelerate launch` was not given one.
    * DeepSpeed's "auto" micro-batch size and clipping are filled from our config, since we do not
      hand accelerate a dataloader to read them from.
    """
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    _drop_inherited_world()
    ds_plugin = None
    env_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed_config and not env_ds:
        ds_plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config,
                                    gradient_accumulation_steps=gradient_accumulation_steps)
    if env_ds or ds_plugin is not None:
        _single_process_env()
    handlers = []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = world > 1
    timeout = dist_timeout()
    if (launched or ds_plugin is not None or env_ds) and not torch.cuda.is_available():
        # DeepSpeed always builds a process group (one process too): gloo is torch's CPU backend
        handlers.append(InitProcessGroupKwargs(backend="gloo", timeout=timeout))
    elif timeout is not None:
        handlers.append(InitProcessGroupKwargs(timeout=timeout))
    if not torch.cuda.is_available() and (env_ds or ds_plugin is not None):
        _skip_cpu_shm_op()
    kwargs: dict[str, Any] = dict(
        kwargs_handlers=handlers,
        cpu=(device == "cpu"),
    )
    if mixed_precision:
        kwargs["mixed_precision"] = mixed_precision
    if ds_plugin is not None:
        kwargs["deepspeed_plugin"] = ds_plugin
    try:
        acc = Accelerator(**kwargs)
    except Exception as e:  # noqa: BLE001 - only a rendezvous timeout is ours to explain; the rest re-raised
        if not (launched and _is_join_timeout(e)):
            raise
        waited = f"{timeout.total_seconds():g} s" if timeout else "torch's default 1800 s"
        raise RunError(f"only part of the {world} processes joined at {os.environ.get('MASTER_ADDR')}:"
                       f"{os.environ.get('MASTER_PORT')} within {waited} (RL_DIST_TIMEOUT); start every "
                       f"machine's launch command with the same --main_process_ip/--main_process_port, check "
                       f"that the port is reachable, or raise RL_DIST_TIMEOUT") from None
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # DeepSpeed's 1 process too
        atexit.register(_close_process_group)
    if acc.device.type == "cpu":  # a step's large blocks kept for the next step
        host_memory.keep_freed_memory()
    if (env_ds or ds_plugin is not None) and not is_deepspeed(acc):
        # accelerate drops DeepSpeed without a word when it is told to use the CPU (measured: two machines with
        # ACCELERATE_USE_CPU=true trained as plain DDP, "ZeRO stage 0"); a run must not silently lose ZeRO
        raise ConfigError(f"DeepSpeed was asked for ({'accelerate launch --use_deepspeed' if env_ds else 'key deepspeed'})"
                          f" but accelerate set up {acc.distributed_type.value} because it was told to use the CPU "
                          f"(ACCELERATE_USE_CPU=true or device=cpu); unset ACCELERATE_USE_CPU and drop device=cpu "
                          f"(DeepSpeed runs on the CPU without them), or drop DeepSpeed")
    plugin = acc.state.deepspeed_plugin
    if plugin is not None:
        ds = plugin.deepspeed_config
        fit_deepspeed_batch(acc, gradient_accumulation_steps, micro_batch_size)
        if ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = float(max_grad_norm) if max_grad_norm else 0.0
    return acc


def fit_deepspeed_batch(accelerator, gradient_accumulation_steps: int, micro_batch_size: int | None = None) -> None:
    """Write our accumulation steps (and, when given, the micro-batch size and the global batch size
    they make) into the accelerator's DeepSpeed config, which DeepSpeed builds its engine from."""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    if micro_batch_size is not None:
        ds["train_micro_batch_size_per_gpu"] = micro_batch_size
        ds["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * accelerator.num_processes
    ds["gradient_accumulation_steps"] = gradient_accumulation_steps


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def is_zero3(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameters are ZeRO-3 partitioned (DeepSpeed tags each with a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def zero_stage(accelerator) -> int:
    if not is_deepspeed(accelerator):
        return 0
    return int(accelerator.state.deepspeed_plugin.zero_stage or 0)


def inner_optimizer(optimizer):
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` wrapper (or `optimizer` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def finish_partial_accumulation(model, accelerator, k: int, n: int) -> None:
    """After k < N micro-batches, each backward scaled by 1/N, the gradients hold (1/N) sum_i g_i:
    rescale by N/k to the mean (1/k) sum_i g_i, which is what N micro-batches would give when k = N.
    Under DDP the k-th backward ran in `no_sync` (it could not know it was the last), so average
    across processes here, as DDP's own all-reduce would (every process must call it after the same
    k); any other multi-process setup is refused (RuntimeError)."""
    from torch.nn.parallel import DistributedDataParallel

    factor = n / k
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    ddp = isinstance(model, DistributedDataParallel) and accelerator.num_processes > 1
    if accelerator.num_processes > 1 and not ddp:
        raise RuntimeError(f"optim_step after {k} of {n} micro-batches is "
                           f"supported single-process and under DDP, not under {accelerator.distributed_type}")
    if ddp:
        factor /= accelerator.num_processes
    for g in grads:
        if ddp:
            torch.distributed.all_reduce(g)
        g.mul_(factor)


def place_frozen(model, accelerator):
    """Put a frozen model (a reference) where the policy runs, in eval mode: under ZeRO-3 its own
    DeepSpeed inference engine, so that each rank holds a shard of it like the policy's; otherwise a
    plain module on the device (no DDP wrapper: it has no gradients). The one placement rule for every
    frozen model of every trainer (rl.models.reference) and of the client."""
    model.eval()
    if zero_stage(accelerator) == 3:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=reference_ds_config(accelerator))
        engine.eval()
        return engine
    return model.to(accelerator.device)


def reference_ds_config(accelerator) -> dict:
    """The policy's DeepSpeed config for a frozen model: no optimizer/scheduler, no "auto" left.

    Accelerate fills most "auto" values when the policy is prepared; batch sizes still "auto" (no
    dataloader) become 1 per rank, and unresolved ZeRO bucket sizes fall back to DeepSpeed's defaults."""
    import copy

    ds = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    ds.pop("optimizer", None)
    ds.pop("scheduler", None)
    gas = ds.get("gradient_accumulation_steps")
    gas = 1 if gas in (None, "auto") else int(gas)
    ds["gradient_accumulation_steps"] = gas
    mbs = ds.get("train_micro_batch_size_per_gpu")
    mbs = 1 if mbs in (None, "auto") else int(mbs)
    ds["train_micro_batch_size_per_gpu"] = mbs
    ds["train_batch_size"] = mbs * gas * accelerator.num_processes
    if ds.get("gradient_clipping") == "auto":
        ds["gradient_clipping"] = 0.0
    zero = ds.get("zero_optimization", {})
    for k in [k for k, v in zero.items() if v == "auto"]:
        del zero[k]
    for prec in ("bf16", "fp16"):
        if isinstance(ds.get(prec), dict) and ds[prec].get("enabled") == "auto":
            ds[prec]["enabled"] = accelerator.mixed_precision == prec
    return ds


def unwrap_module(model):
    """The module to call: DeepSpeed engines and DDP wrap the HF model in `.module`."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model
