"""Run untrusted, model-generated Python in a separate, resource-limited, isolated process:
`run_python(code, ...) -> SandboxResult`.

Nothing here executes model code in the calling process: every program runs in a child
`python -I -S` (isolated mode: PYTHON* variables, the user site and `site`/`sitecustomize`/`.pth`
hooks are all off) started in its own session, so a timeout kills its whole process group. The
program and its `files` are written to a fresh working directory; the runner (`_RUNNER`) applies the
limits inside the child, then runs the program as __main__.

Isolation: the child gets the best level this machine gives (`rl.envs.isolation.isolation_level()`:
"private-root", "network" or "none"; that module says what each holds and how it is built);
`SandboxResult.isolation` and `.mechanism` say which one ran. Under a private root the files arrive
read-only at `isolation.INPUT_DIR` and are copied into a working directory on the root's tmpfs.
`run_python(..., require_private_root=True)` raises rather than run below "private-root"; the code
environment and the python tool do that unless their config says `sandbox: unisolated`.

Limits (every level)
- Wall time: the parent waits `timeout` seconds, then SIGKILLs the process group (and, with namespaces,
  the whole PID namespace, which also catches children that called `setsid`).
- CPU time: RLIMIT_CPU (the kernel kills the process when it is spent; the soft limit's SIGXCPU
  becomes exit status 152, `SandboxResult.cpu_exceeded`).
- Memory: RLIMIT_AS (address space) per process; allocations past it raise MemoryError in the child.
- Processes: where this user may create a pids cgroup (root in a container with cgroup v1, or a
  delegated v2 subtree), the child runs in one with `pids.max = max_processes`, so a fork bomb stops
  at that many; inside a user namespace RLIMIT_NPROC is set too (the kernel ignores it for real root).
- Files written: RLIMIT_FSIZE per file (which also bounds captured stdout/stderr); RLIMIT_NOFILE; no
  core; with a private root all writes land in the `disk_mb` tmpfs.
- Network: no route out in a network namespace ("Network is unreachable"); as a second, weaker layer
  the runner replaces `socket.socket` before user code runs.
- Environment: reduced to PATH/HOME/TMPDIR/LANG; HOME and TMPDIR are the working directory.

What is NOT isolated
- Below "private-root", the file system: the child runs as the trainer's user and can read and write
  whatever that user can.
- The kernel: namespaces are not a VM; a kernel exploit escapes them. /proc shows host-wide
  information (CPU, memory, kernel version), not other processes.
- Without a pids cgroup and as root, a fork bomb is bounded by the wall-time kill and the PID
  namespace (its lifetime), not by a process count; total memory is per-process times processes.
- Without user namespaces, the socket block is Python-level only and can be bypassed (e.g. `_socket`).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from rl.envs import isolation

# Runs inside the child before the user program: copy the program's files into its working directory
# (with a private root they arrive read-only at INPUT_DIR), apply limits (they bind this process and
# its children), disable sockets as a second layer, then run the program as __main__.
_RUNNER = r"""
import resource, sys
cpu, mem, fsize, nofile, nproc = (int(v) for v in sys.argv[1:6])
block_net, path, src = sys.argv[6] == "1", sys.argv[7], sys.argv[8]
if src != "-":
    import shutil
    shutil.copytree(src, ".", dirs_exist_ok=True)
    del shutil
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
if nproc > 0:
    lim(resource.RLIMIT_NPROC, nproc)
if block_net:
    import socket
    class _NoNetwork(socket.socket):
        def __init__(self, *a, **k):
            raise OSError("network access is disabled in the sandbox")
    socket.socket = _NoNetwork
    socket.create_connection = lambda *a, **k: _NoNetwork()
del resource, lim, os, signal, cpu, mem, fsize, nofile, nproc, block_net, src
sys.argv = [path]
import runpy
runpy.run_path(path, run_name="__main__")
"""


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run. `ok` means exit status 0 within the limits."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_time: float
    network_isolated: bool
    isolation: str = "none"  # one of ISOLATION_LEVELS: what this run actually had
    mechanism: str = "none"  # "bwrap", "unshare" or "none": what provided it

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def filesystem_isolated(self) -> bool:
        return self.isolation == "private-root"

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
def _pids_cgroup_parent() -> str | None:
    """A directory in which this process may create pids cgroups (cgroup v1's pids hierarchy, or a v2
    subtree with the pids controller), found by trying once; None when there is none."""
    candidates = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "pids" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/pids") / rel.lstrip("/"))
        elif controllers == "" and "pids" in _read("/sys/fs/cgroup/cgroup.controllers").split():
            candidates.append(Path("/sys/fs/cgroup") / rel.lstrip("/"))
    for parent in candidates:
        probe = parent / f"rl-sandbox-probe-{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            continue
        try:
            # Creating is not joining (cgroup v2 refuses tasks in an inner node): try what run_python does.
            ok = (probe / "pids.max").exists() and subprocess.run(
                ["/bin/sh", "-c", isolation.JOIN_CGROUP, str(probe)], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        _remove_cgroup(str(probe))
        if ok:
            return str(parent)
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _make_pids_cgroup(max_processes: int) -> str | None:
    """A fresh pids cgroup limited to `max_processes` tasks, or None where none can be made."""
    parent = _pids_cgroup_parent()
    if parent is None or max_processes <= 0:
        return None
    path = os.path.join(parent, f"rl-sandbox-{uuid.uuid4().hex[:12]}")
    try:
        os.mkdir(path)
        Path(path, "pids.max").write_text(str(max_processes))
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return None
    return path


def _remove_cgroup(path: str) -> None:
    """Kill whatever is left in the cgroup, then remove it (rmdir fails while tasks remain)."""
    for _ in range(50):
        pids = [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.02)


def _read_head_limited(path: str, limit: int) -> str:
    with open(path, "rb") as fh:
        data = fh.read(limit)
    return data.decode("utf-8", errors="replace")


def run_python(code: str, *, timeout: float = 5.0, cpu_seconds: int | None = None, memory_mb: int = 512,
               max_output_bytes: int = 1 << 20, stdin: str | None = None, files: dict[str, str] | None = None,
               isolate_network: bool = True, require_network_isolation: bool = False,
               require_private_root: bool = False, max_processes: int = 32, disk_mb: int = 64) -> SandboxResult:
    """Run `code` as a Python program in a sandboxed child process and return its outcome.

    timeout: wall-clock seconds before the whole process group is SIGKILLed.
    cpu_seconds: RLIMIT_CPU (default: ceil(timeout) + 1, so the wall clock normally fires first).
    memory_mb: RLIMIT_AS in MiB (address space, so keep headroom over the interpreter's ~30 MiB).
    max_output_bytes: per-stream cap on captured stdout/stderr (also the RLIMIT_FSIZE of written files).
    files: extra {relative name: text} written into the working directory before the run.
    isolate_network=False: no namespaces at all (the file system is then the host's too).
    require_network_isolation: raise RuntimeError when network namespaces are unavailable.
    require_private_root: raise RuntimeError unless the child can get a private root (bwrap or unshare).
    max_processes: pids-cgroup limit on the child's tasks, where such a cgroup can be made.
    disk_mb: size of the private root's writable tmpfs (everything the program may write).
    """
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout ({timeout}) and memory_mb ({memory_mb}) must be positive")
    cpu = int(cpu_seconds if cpu_seconds is not None else int(timeout) + 1)
    level = isolation.isolation_level() if isolate_network else "none"
    if require_private_root and level != "private-root":
        raise RuntimeError(isolation.NO_PRIVATE_ROOT)
    if isolate_network and require_network_isolation and level == "none":
        raise RuntimeError("network isolation requested but `unshare --user --net` is unavailable here; "
                           "enable unprivileged user namespaces or pass require_network_isolation=False")
    workdir = tempfile.mkdtemp(prefix="rl-sandbox-")
    iodir = tempfile.mkdtemp(prefix="rl-sandbox-io-")  # outside the program's cwd
    cgroup, mechanism = None, "none"
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
        # Inside a user namespace RLIMIT_NPROC counts only the sandbox's own processes.
        nproc = max_processes if level != "none" else 0
        argv = [isolation.interpreter(), "-I", "-S", "-c", _RUNNER, str(cpu), str(memory_mb << 20),
                str(max_output_bytes), "256", str(nproc), "1" if isolate_network else "0", prog,
                isolation.INPUT_DIR if level == "private-root" else "-"]
        if level == "private-root":
            # The same path inside, on the private tmpfs; the host directory is only read (copied in).
            mountpoint = os.path.join(iodir, "root")  # empty on the host; the root's tmpfs covers it inside
            os.mkdir(mountpoint)
            mechanism = isolation.private_root_mechanism()
            argv = [*isolation.private_root_argv(mechanism, workdir, workdir, disk_mb << 20, mountpoint), *argv]
        elif level == "network":
            mechanism = "unshare"
            argv = [*isolation.NS_ARGV, *argv]
        cgroup = _make_pids_cgroup(max_processes)
        if cgroup is not None:
            # Join the cgroup before anything forks: the shell moves itself in, then becomes the sandbox.
            argv = ["/bin/sh", "-c", isolation.JOIN_CGROUP + ' && exec "$@"', cgroup, *argv]
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
                             stdout=_read_head_limited(out_path, max_output_bytes),
                             stderr=_read_head_limited(err_path, max_output_bytes),
                             timed_out=timed_out, wall_time=wall, network_isolated=level != "none",
                             isolation=level, mechanism=mechanism)
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(iodir, ignore_errors=True)
