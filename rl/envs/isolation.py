"""Isolation for the sandbox (rl.envs.sandbox): which namespaces this machine lets a child have, probed
once per process, and the command prefixes that put a program inside them.

Isolation levels (`isolation_level()`, best first, one of ISOLATION_LEVELS):
- "private-root": new user, mount, PID, network, IPC and UTS namespaces and a root of its own: /usr
  (and the /bin, /lib* links) plus the Python installation read-only, a fresh /proc of its own PID
  namespace, a minimal /dev, a read-only root, and one writable, size-capped tmpfs at /tmp holding
  its working directory; the program's files are bound read-only at INPUT_DIR. Nothing else exists
  in it: not the checkout, /home, /root, /work, the output or cache directories, /etc, /var or the
  host's /tmp. All capabilities are dropped, so it cannot remount anything. Built by Debian's
  `bubblewrap` (`bwrap`, `_bwrap_argv`) where it works, else by util-linux alone (`unshare` + `mount`
  + `pivot_root` + `setpriv`, `_unshare_root_argv`); `private_root_mechanism()` says which, and
  `private_root_argv(mechanism, ...)` gives its command prefix.
- "network": `NS_ARGV`, i.e. `unshare --user --map-root-user --net --pid --fork --kill-child` (no
  private root possible): an empty network namespace and a private PID namespace, but the file
  system is the host's.
- "none": resource limits only (no namespaces at all).

Each mechanism is probed by running it (`_private_root_works`: the probe must start Python and must not
see a file of this process), because a tool may be installed yet unable to create namespaces. The
child's interpreter is the base installation's real binary (`interpreter()`), never a venv's link, so
only the standard library needs binding in. `NO_PRIVATE_ROOT` is the one-line refusal with its fixes;
`JOIN_CGROUP` is the shell line that moves the sandbox's first process into its pids cgroup.

Not isolated at any level: the kernel (namespaces are not a VM; see rl.envs.sandbox for the rest).
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

# `unshare` without a private root: the "network" level (empty network namespace, private PID namespace).
NS_ARGV = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]
INPUT_DIR = "/.rl-input"  # where, under a private root, the program's files arrive read-only
ISOLATION_LEVELS = ("private-root", "network", "none")
JOIN_CGROUP = 'echo $$ > "$0/cgroup.procs"'  # sh: move this shell into the cgroup named by $0
# System directories bound read-only into a private root (or recreated as the symlinks they are).
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def interpreter() -> str:
    """The real Python binary (not a venv's link to it): the child needs only the standard library,
    and with a private root only the base installation is bound in, never the venv or checkout."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _python_dirs() -> list[str]:
    """Directories of the Python installation outside the system directories (e.g. pyenv under
    /root): bound read-only so the interpreter finds its standard library."""
    dirs = []
    for d in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(interpreter())):
        d = os.path.realpath(d)
        if d in ("/", "") or any(d == s or d.startswith(s + "/") for s in _SYSTEM_DIRS):
            continue
        if not any(d == k or d.startswith(k + "/") for k in dirs):
            dirs.append(d)
    return dirs


def _bwrap_argv(workdir: str, srcdir: str, disk_bytes: int) -> list[str]:
    """bubblewrap arguments for a private root: system and Python read-only, fresh /proc and /dev,
    a `disk_bytes` tmpfs at /tmp with `workdir` in it, `srcdir` read-only at INPUT_DIR."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--hostname", "sandbox"]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for d in _python_dirs():
        argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(disk_bytes), "--perms", "0700", "--tmpfs", "/tmp",
             "--dir", workdir, "--ro-bind", srcdir, INPUT_DIR,
             # bwrap's own root and /dev are tmpfs without a size limit: read-only, or a program could
             # fill this machine's memory through them.
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", workdir, "--"]
    return argv


def _unshare_root_argv(mountpoint: str, workdir: str, srcdir: str, disk_bytes: int) -> list[str]:
    """The same private root as `_bwrap_argv` from util-linux alone (`unshare`, `mount`, `pivot_root`,
    `setpriv`), for machines without bubblewrap: a shell in new user/mount/PID/network namespaces
    builds the root on a tmpfs over the empty host directory `mountpoint`, pivots into it, detaches
    the old root, and execs the command with every capability gone for good (empty bounding set,
    `noroot` securebits, no_new_privs), so the program cannot remount anything read-write."""
    q, root = shlex.quote, mountpoint.rstrip("/")
    lines = ["set -eu", 'ENV_PATH="$PATH"', "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "mount --make-rprivate /",
             f"mount -t tmpfs -o size=1m,mode=0755 tmpfs {q(root)}"]

    def ro_bind(src: str, dst: str) -> None:
        lines.extend([f"mkdir -p {q(root + dst)}", f"mount --bind {q(src)} {q(root + dst)}",
                      f"mount -o remount,bind,ro {q(root + dst)}"])

    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            lines.append(f"ln -s {q(os.readlink(d))} {q(root + d)}")
        elif os.path.isdir(d):
            ro_bind(d, d)
    for d in _python_dirs():
        ro_bind(d, d)
    ro_bind(srcdir, INPUT_DIR)
    lines += [f"mkdir -p {q(root)}/proc {q(root)}/dev {q(root)}/tmp {q(root)}/.old",
              f"mount -t proc -o nosuid,nodev,noexec proc {q(root)}/proc"]
    for dev in ("null", "zero", "random", "urandom"):
        lines += [f"touch {q(root)}/dev/{dev}", f"mount --bind /dev/{dev} {q(root)}/dev/{dev}"]
    lines += [f"mount -t tmpfs -o size={disk_bytes},mode=0700,nosuid,nodev tmpfs {q(root)}/tmp",
              f"mkdir -p {q(root + workdir)}", f"cd {q(root)}", "pivot_root . .old", "umount -l /.old",
              "rmdir /.old", "mount -o remount,bind,ro /", "cd /", f"cd {q(workdir)}", "unset OLDPWD",
              'PATH="$ENV_PATH" exec setpriv --no-new-privs --inh-caps=-all --ambient-caps=-all '
              "--bounding-set=-all --securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked,"
              '+keep_caps_locked -- "$@"']
    return ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
            "--kill-child", "/bin/sh", "-c", "\n".join(lines), "rl-sandbox-root"]


def private_root_argv(mechanism: str, workdir: str, srcdir: str, disk_bytes: int, mountpoint: str) -> list[str]:
    """The command prefix that runs a program under a private root built by `mechanism` ('bwrap' or
    'unshare', see `private_root_mechanism`); `mountpoint` is an empty host directory (unshare only)."""
    if mechanism == "bwrap":
        return _bwrap_argv(workdir, srcdir, disk_bytes)
    return _unshare_root_argv(mountpoint, workdir, srcdir, disk_bytes)


def _private_root_works(mechanism: str) -> bool:
    """Run a probe under `mechanism`: it must start Python and must not see a file of this process."""
    if shutil.which("bwrap" if mechanism == "bwrap" else "unshare") is None:
        return False
    tmp = tempfile.mkdtemp(prefix="rl-sandbox-probe-")
    try:
        src, mnt = os.path.join(tmp, "src"), os.path.join(tmp, "root")
        os.mkdir(src)
        os.mkdir(mnt)
        secret = os.path.join(tmp, "outside")
        open(secret, "w").close()
        argv = [*private_root_argv(mechanism, "/tmp/probe", src, 1 << 20, mnt), interpreter(), "-I", "-S", "-c",
                f"import os; assert not os.path.exists({secret!r}) and os.getcwd() == '/tmp/probe'"]
        proc = subprocess.run(argv, capture_output=True, timeout=10, env={"PATH": os.defpath}, cwd=tmp)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return proc.returncode == 0


@functools.lru_cache(maxsize=1)
def _bwrap_works() -> bool:
    return _private_root_works("bwrap")


@functools.lru_cache(maxsize=1)
def _unshare_root_works() -> bool:
    return _private_root_works("unshare")


def private_root_mechanism() -> str | None:
    """'bwrap' or 'unshare' (util-linux only), whichever first gives a private root here (each is
    probed once: a tool may be installed yet unable to create namespaces); None when neither does."""
    if _bwrap_works():
        return "bwrap"
    return "unshare" if _unshare_root_works() else None


def private_root_available() -> bool:
    """Whether the child can get a private root on this machine."""
    return private_root_mechanism() is not None


@functools.lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether the child gets private user/network/PID namespaces (bubblewrap or `unshare`)."""
    if private_root_available():
        return True
    if shutil.which("unshare") is None:
        return False
    try:
        proc = subprocess.run([*NS_ARGV, interpreter(), "-I", "-S", "-c", "pass"],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def isolation_level() -> str:
    """The best isolation this machine gives (one of ISOLATION_LEVELS)."""
    if private_root_available():
        return "private-root"
    return "network" if namespaces_available() else "none"


NO_PRIVATE_ROOT = ("the sandbox cannot give generated code a private root here: neither bubblewrap (`bwrap`) nor "
                   "`unshare --user --mount` can create namespaces; install bubblewrap (`apt-get install "
                   "bubblewrap`), allow unprivileged user namespaces, or, to run "
                   "generated code with resource limits only, seeing this machine's files, set "
                   "sandbox: unisolated")
