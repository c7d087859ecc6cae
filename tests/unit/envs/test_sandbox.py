"""The sandbox runs model code in a limited child process and always comes back (rl/envs/sandbox.py)."""

from __future__ import annotations

import os
import time

import pytest

from rl.envs.isolation import namespaces_available
from rl.envs.sandbox import run_python


def test_runs_a_program_in_a_temporary_directory():
    res = run_python("import os, sys\nprint(os.getcwd())\nprint(sys.flags.isolated, sys.flags.no_site)\n"
                     "open('out.txt', 'w').write('x')")
    assert res.ok and not res.timed_out, res.stderr
    cwd, flags = res.stdout.splitlines()
    assert os.path.basename(cwd).startswith("rl-sandbox-")
    assert flags == "1 1"  # python -I -S: no user site, no sitecustomize
    assert not os.path.exists(cwd), "the working directory is removed afterwards"


def test_failure_and_stdin():
    res = run_python("raise SystemExit(3)")
    assert res.returncode == 3 and not res.ok
    res = run_python("import sys\nprint(sys.stdin.read().upper())", stdin="abc")
    assert res.stdout.strip() == "ABC"


@pytest.mark.slow
def test_infinite_loop_killed_at_wall_time():
    # the loop never ends by itself and its CPU limit (30 s) is far away: only the 1 s deadline ends it
    res = run_python("while True:\n    pass", timeout=1.0, cpu_seconds=30)
    assert res.timed_out and not res.ok and res.returncode is None


@pytest.mark.slow
def test_sleeping_child_and_orphaned_grandchild_killed():
    # A grandchild in its own session escapes a process-group kill; the PID namespace still ends it.
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    res = run_python(code, timeout=1.0)
    assert res.timed_out
    if namespaces_available():
        # The grandchild's pid is namespace-local; prove instead that nothing sleeping survived.
        time.sleep(0.2)
        survivors = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith("time.sleep(60)")]
        assert survivors == []


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@pytest.mark.slow
def test_cpu_limit_ends_busy_loop():
    res = run_python("while True:\n    pass", timeout=20, cpu_seconds=1)
    # not timed out: ended by RLIMIT_CPU before the 20 s deadline (exit 152 from SIGXCPU, or the hard-limit kill)
    assert not res.timed_out and not res.ok
    assert res.returncode != 0


@pytest.mark.parametrize("bomb", [
    "x = bytearray(8 * 1024 ** 3)",                                     # one huge allocation
    "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))",              # creeping growth
])
def test_memory_bomb_stops_at_limit_and_parent_survives(bomb):
    before = _rss_mb()
    res = run_python(bomb, timeout=20, memory_mb=256)
    assert not res.ok and not res.timed_out
    assert "MemoryError" in res.stderr  # and, not timed out, before the 20 s deadline
    assert _rss_mb() - before < 50, "the parent process must not grow"
    assert run_python("print('still fine')").stdout.strip() == "still fine"


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_network_is_blocked():
    res = run_python("import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))")
    assert not res.ok and "OSError" in res.stderr
    if namespaces_available():
        # Even the raw extension module (bypassing the Python-level block) has no route out.
        res = run_python("import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))")
        assert not res.ok and "unreachable" in res.stderr.lower()
        assert res.network_isolated


def test_output_is_capped():
    res = run_python("import sys\nsys.stdout.write('x' * 5_000_000)", max_output_bytes=10_000)
    assert len(res.stdout) <= 10_000


def test_extra_files_and_escape_rejected():
    res = run_python("print(open('data/in.txt').read())", files={"data/in.txt": "hello"})
    assert res.stdout.strip() == "hello"
    with pytest.raises(ValueError, match="escapes"):
        run_python("pass", files={"../evil.txt": "x"})


def test_bad_limits():
    with pytest.raises(ValueError, match="positive"):
        run_python("pass", timeout=0)
