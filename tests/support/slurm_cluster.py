"""A real Slurm cluster of two nodes on this host, for tests: munged, slurmctld and one slurmd per node, all from
Debian's slurm-wlm, configured in a private directory with their own ports and socket. GPUs are character devices
(/dev/null's numbers) declared through gres.conf, so Slurm hands them out and sets CUDA_VISIBLE_DEVICES per task."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import random
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")


def slurm_missing() -> str | None:
    """Why this host cannot run the test cluster, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their user)"
    missing = [b for b in SLURM_BINARIES if not shutil.which(b) and not Path("/usr/sbin", b).exists()]
    return f"Slurm not installed ({', '.join(missing)}); apt-get install slurm-wlm munge" if missing else None


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768+): srun, slurmd and gRPC clients take ephemeral
    ports all the time, and one of them taking ours between this check and the real bind failed a job once."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """``nodes`` nodes named node1.. with ``cpus`` CPUs and ``gpus`` fake GPUs each; ``env`` carries SLURM_CONF."""

    def __init__(self, nodes: int = 2, cpus: int = 2, gpus: int = 2):
        self.dir = Path(tempfile.mkdtemp(prefix="dps"))  # short: the munge socket path has a length limit
        self.nodes, self.cpus, self.gpus = nodes, cpus, gpus
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

    def _write_config(self) -> None:
        d, host = self.dir, socket.gethostname()
        for sub in ("state", "log", *(f"spoolnode{i}" for i in range(1, self.nodes + 1))):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        for g in range(self.nodes * self.gpus):
            subprocess.run(["mknod", str(d / f"gpu{g}"), "c", "1", "3"], check=True)
        ctl, slurmd = free_port(), free_port()
        conf = [
            f"ClusterName=dptest{os.getpid()}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl}",
            f"SlurmdPort={slurmd}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={d}/munge.sock",
            "CredType=cred/munge",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "KillWait=10",
            "MinJobAge=600",
        ]
        gres = []
        for i in range(1, self.nodes + 1):
            conf.append(
                f"NodeName=node{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                f"CPUs={self.cpus} RealMemory=8000 Gres=gpu:{self.gpus} State=UNKNOWN"
            )
            first = (i - 1) * self.gpus
            gres.append(f"NodeName=node{i} Name=gpu File={d}/gpu[{first}-{first + self.gpus - 1}]")
        conf.append(
            f"PartitionName=debug Nodes=node[1-{self.nodes}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
        )
        (d / "slurm.conf").write_text("\n".join(conf) + "\n")
        (d / "gres.conf").write_text("\n".join(gres) + "\n")

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        """Start the daemons and wait for idle nodes; on failure nothing is left running."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> "SlurmCluster":
        self._write_config()
        d, conf = self.dir, str(self.dir / "slurm.conf")
        subprocess.run(
            [
                _binary("munged"),
                f"--socket={d}/munge.sock",
                f"--key-file={d}/munge.key",
                f"--log-file={d}/log/munged.log",
                f"--pid-file={d}/munged.pid",
                f"--seed-file={d}/munge.seed",
                "--force",
            ],
            check=True,
            env=self.env,
        )
        self.procs.append(
            subprocess.Popen(
                [_binary("slurmctld"), "-D", "-f", conf, "-i"],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for i in range(1, self.nodes + 1):
            self.procs.append(
                subprocess.Popen(
                    [_binary("slurmd"), "-D", "-f", conf, "-N", f"node{i}"],
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            if len(out) == self.nodes and all(s in ("idle", "mixed") for s in out):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s:\n{self.log('slurmctld')[-3000:]}")

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_binary(cmd[0]), *cmd[1:]], env=self.env, capture_output=True, text=True, check=check, timeout=60, **kw
        )

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def log(self, name: str) -> str:
        p = self.dir / "log" / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        pid = self.dir / "munged.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
