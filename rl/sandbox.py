"""Run untrusted, model-generated Python in a separate, resource-limited process.

Nothing here executes model code in the calling process: every program runs in a child
`python -I -S` (isolated mode: PYTHON* variables, the user site and `site`/`sitecustomize`/`.pth`
hooks are all off) started in its own session, so a timeout kills its whole process group.

What IS isolated / limited
- Wall time: the parent waits `timeout` seconds, then SIGKILLs the process group (and, with namespaces,
  the whole PID namespace, which also catches children that called `setsid`).
- CPU time: RLIMIT_CPU (the kernel kills the process when it is spent).
- Memory: RLIMIT_AS (address space); allocations past it raise MemoryError inside the child.
- Files written: RLIMIT_FSIZE per file (which also bounds captured stdout/stderr); RLIMIT_NOFILE; no core.
- Network: when unprivileged user namespaces are available (probed once, see `namespaces_available`),
  the child runs under `unshare --user --map-root-user --net --pid --fork --kill-child`: an empty network
  namespace (only a down loopback), so connections fail with "Network is unreachable", and a private PID
  namespace. As a second, weaker layer the runner replaces `socket.socket` before user code runs.
  `SandboxResult.network_isolated` says whether the namespace layer was in force.
- Working directory: a fresh temporary directory, deleted afterwards; HOME and TMPDIR point into it and
  the environment is reduced to PATH/HOME/TMPDIR/LANG.

What is NOT isolated
- The filesystem: the child runs as the same user and can read (and write) whatever that user can.
  Use a container or a dedicated low-privilege user if that matters for your threat model.
- Fork bombs when running as root (RLIMIT_NPROC is not enforced for root); the PID namespace plus the
  wall-time kill bounds their lifetime, not their rate.
- Without user namespaces, the socket block is Python-level only and can be bypassed (e.g. `_socket`).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Runs inside the child before the user program: apply limits (they survive nothing but this
# process and its children), disable sockets as a second layer, then run the program as __main__.
_RUNNER = r"""
import resource, sys
cpu, mem, fsize, nofile = (int(v) for v in sys.argv[1:5])
block_net, path = sys.argv[5] == "1", sys.argv[6]
def lim(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass
try:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
except (ValueError, OSError):
    pass
import os, signal
# The soft limit's SIGXCPU becomes a recognisable exit status (152); the hard limit SIGKILLs anyway.
signal.signal(signal.SIGXCPU, lambda *_, _exit=os._exit, _code=128 + signal.SIGXCPU: _exit(_code))
lim(resource.RLIMIT_AS, mem)
lim(resource.RLIMIT_FSIZE, fsize)
lim(resource.RLIMIT_NOFILE, nofile)
lim(resource.RLIMIT_CORE, 0)
if block_net:
    import socket
    class _NoNetwork(socket.socket):
        def __init__(self, *a, **k):
            raise OSError("network access is disabled in the sandbox")
    socket.socket = _NoNetwork
    socket.create_connection = lambda *a, **k: _NoNetwork()
del resource, lim, os, signal, cpu, mem, fsize, nofile, block_net
sys.argv = [path]
import runpy
runpy.run_path(path, run_name="__main__")
"""

_NS_ARGV = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run. `ok` means exit status 0 within the limits."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_time: float
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def cpu_exceeded(self) -> bool:
        """The CPU-time limit ended the run (SIGXCPU handled as exit 152, or SIGXCPU itself)."""
        return self.returncode in (128 + signal.SIGXCPU, -signal.SIGXCPU)

    @property
    def killed_by_signal(self) -> int | None:
        """The signal number that ended the child (e.g. SIGKILL for CPU limit), or None."""
        if self.returncode is not None and self.returncode < 0:
            return -self.returncode
        return None


@functools.lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether `unshare` can give the child private user/network/PID namespaces on this machine."""
    if shutil.which("unshare") is None:
        return False
    try:
        proc = subprocess.run([*_NS_ARGV, sys.executable, "-I", "-S", "-c", "pass"],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _read_tail_limited(path: str, limit: int) -> str:
    with open(path, "rb") as fh:
        data = fh.read(limit)
    return data.decode("utf-8", errors="replace")


def run_python(code: str, *, timeout: float = 5.0, cpu_seconds: int | None = None, memory_mb: int = 512,
               max_output_bytes: int = 1 << 20, stdin: str | None = None, files: dict[str, str] | None = None,
               isolate_network: bool = True, require_network_isolation: bool = False) -> SandboxResult:
    """Run `code` as a Python program in a sandboxed child process and return its outcome.

    timeout: wall-clock seconds before the whole process group is SIGKILLed.
    cpu_seconds: RLIMIT_CPU (default: ceil(timeout) + 1, so the wall clock normally fires first).
    memory_mb: RLIMIT_AS in MiB (address space, so keep headroom over the interpreter's ~30 MiB).
    max_output_bytes: per-stream cap on captured stdout/stderr (also the RLIMIT_FSIZE of written files).
    files: extra {relative name: text} written into the working directory before the run.
    require_network_isolation: raise RuntimeError when network namespaces are unavailable.
    """
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout ({timeout}) and memory_mb ({memory_mb}) must be positive")
    cpu = int(cpu_seconds if cpu_seconds is not None else int(timeout) + 1)
    use_ns = isolate_network and namespaces_available()
    if isolate_network and require_network_isolation and not use_ns:
        raise RuntimeError("network isolation requested but `unshare --user --net` is unavailable here; "
                           "enable unprivileged user namespaces or pass require_network_isolation=False")
    workdir = tempfile.mkdtemp(prefix="rl-sandbox-")
    iodir = tempfile.mkdtemp(prefix="rl-sandbox-io-")  # outside the program's cwd
    try:
        prog = os.path.join(workdir, "main.py")
        with open(prog, "w", encoding="utf-8") as fh:
            fh.write(code)
        for name, text in (files or {}).items():
            target = os.path.realpath(os.path.join(workdir, name))
            if not target.startswith(os.path.realpath(workdir) + os.sep):
                raise ValueError(f"sandbox file name {name!r} escapes the working directory")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w", encoding="utf-8") as fh:
                fh.write(text)
        argv = [sys.executable, "-I", "-S", "-c", _RUNNER, str(cpu), str(memory_mb << 20),
                str(max_output_bytes), "256", "1" if isolate_network else "0", prog]
        if use_ns:
            argv = [*_NS_ARGV, *argv]
        env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        out_path, err_path = os.path.join(iodir, "stdout"), os.path.join(iodir, "stderr")
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=err,
                                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                if stdin is not None:
                    try:
                        proc.communicate(stdin.encode("utf-8"), timeout=timeout)
                    except (BrokenPipeError, ValueError):
                        pass
                proc.wait(timeout=max(0.0, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # Always kill the group: a finished parent may have left children behind.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        wall = time.monotonic() - start
        return SandboxResult(returncode=None if timed_out else proc.returncode,
                             stdout=_read_tail_limited(out_path, max_output_bytes),
                             stderr=_read_tail_limited(err_path, max_output_bytes),
                             timed_out=timed_out, wall_time=wall, network_isolated=use_ns)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(iodir, ignore_errors=True)
