"""A throwaway single-node Slurm for tests: munge + slurmctld + slurmd on this host, state in a temp dir.

The recipe was measured on these machines (design.md): Debian's slurmd/slurmctld/slurm-client/munge,
the munge key owned by munge, `munged` run as munge, a slurm.conf naming `hostname -s` with
proctrack/linuxproc and task/none, SlurmUser=root. `start()` raises SlurmUnavailable with the reason
when any of that cannot be had (not root, no apt, a daemon that does not come up)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmd", "slurmctld", "slurm-client", "munge"]


class SlurmUnavailable(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_installed(timeout: int = 240) -> None:
    """apt-get install the Slurm packages when sbatch is missing (CI runs as root with Debian's mirror)."""
    if all(shutil.which(b) for b in ("sbatch", "slurmctld", "slurmd", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and apt-get as root is not available")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:  # a stale package index: refresh once
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=timeout)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not shutil.which("sbatch"):
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {r.stderr.strip()[-300:]}")


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 2, gpus: int = 8):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus, self.gpus = cpus, gpus
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._started: list[Path] = []

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        # Stand-in GPUs so that the template's --gpus-per-node is schedulable: slurmd wants one character
        # device per GPU (measured: Count= without File= registers 0 GPUs); links to /dev/null are that.
        for i in range(self.gpus):
            dev = r / f"fakegpu{i}"
            if not dev.is_symlink():
                dev.symlink_to("/dev/null")
        (r / "gres.conf").write_text(f"Name=gpu File={r}/fakegpu[0-{self.gpus - 1}]\n")
        self.conf.write_text(f"""ClusterName=rltest
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
GresTypes=gpu
NodeName={self.host} CPUs={self.cpus} Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout: float = 60) -> "SlurmCluster":
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting slurmctld/slurmd needs root")
        self._write_conf()
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            key = Path("/etc/munge/munge.key")
            if not key.exists():
                subprocess.run(["mungekey", "--create"], capture_output=True)
                shutil.chown(key, "munge", "munge")
            Path("/run/munge").mkdir(exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            r = subprocess.run(["runuser", "-u", "munge", "--", "munged"], capture_output=True, text=True)
            if r.returncode != 0:
                raise SlurmUnavailable(f"munged did not start: {r.stderr.strip()}")
        for daemon, pid in (("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd.pid")):
            r = subprocess.run([daemon], env=self.env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SlurmUnavailable(f"{daemon} did not start: {r.stderr.strip()}")
            self._started.append(self.root / pid)
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        log = (self.root / "log" / "slurmd.log")
        tail = log.read_text()[-500:] if log.exists() else ""
        raise SlurmUnavailable(f"the node did not become idle in {timeout:.0f} s: {tail}")

    def run(self, *args: str, timeout: int = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def job_state(self, job_id: str) -> str:
        r = self.run("scontrol", "show", "job", job_id)
        for tok in r.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    def stop(self) -> None:
        """Stop the daemons this cluster started, by their pid files (munged is left for others)."""
        for pidfile in reversed(self._started):
            try:
                os.kill(int(pidfile.read_text().strip()), 15)
            except (OSError, ValueError):
                pass
        self._started.clear()
