"""rl.engine.dist.run_as_program: a launched program's end where torch.distributed ran skips the interpreter's
teardown (os._exit) but keeps what a normal exit does: main's exit status, other non-daemon threads finished,
atexit hooks run, buffered stdout written, the process group closed after a barrier."""

import subprocess
import sys
import textwrap

from tests.conftest import ROOT, free_port

PROGRAM = textwrap.dedent("""
    import atexit, os, sys, threading, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from rl.engine.dist import run_as_program

    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])

    def late_write():  # a non-daemon thread still working when main returns
        time.sleep(0.5)
        (out / f"thread{rank}").write_text("done")

    def main():
        dist.init_process_group("gloo")
        t = torch.ones(3) * (rank + 1)
        dist.all_reduce(t)
        threading.Thread(target=late_write).start()
        atexit.register(lambda: (out / f"hook{rank}").write_text(str(dist.is_initialized())))
        sys.stdout.write(f"sum {t.tolist()} from rank {rank}")  # no newline: still in the buffer at the end
        if rank == 1:
            raise SystemExit(3)

    run_as_program(main)
    print("unreachable")
""")


def test_a_distributed_program_ends_with_its_status_threads_hooks_and_output(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                                   "RANK": str(rank)})
             for rank in (0, 1)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 3], results
    for rank, (stdout, _) in enumerate(results):
        assert stdout == f"sum [3.0, 3.0, 3.0] from rank {rank}", stdout
        assert (tmp_path / f"thread{rank}").read_text() == "done"
        assert (tmp_path / f"hook{rank}").read_text() == "False"  # the hooks run after the group is closed


def test_without_torch_distributed_it_is_a_plain_exit(tmp_path):
    code = "from rl.engine.dist import run_as_program\nrun_as_program(lambda: print('hi'))\nprint('unreachable')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout) == (0, "hi\n"), done.stderr
    code = "from rl.engine.dist import run_as_program\nrun_as_program(lambda: exit('bad input'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stderr.strip()) == (1, "bad input")
