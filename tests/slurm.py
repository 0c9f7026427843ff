"""A real single-node Slurm cluster for the session: Debian's slurm-wlm and munge, started by this fixture and
stopped by PID afterwards.

Registered by `pytest_plugins` in tests/conftest.py. munged, slurmctld and slurmd run as root on free local ports
with their key, state, spool, logs and `slurm.conf` in a temporary folder (`SLURM_CONF` points the client commands
at it): the host is the only node (CPUs=2), `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`, no
accounting (fedpilot asks squeue; `MinJobAge` keeps ended jobs there for the tests), and a requeued job waits
`CRED_EXPIRE_S + 1` seconds (not Slurm's default two minutes) before it starts again. Without the binaries the tests
skip on a developer machine and fail on CI (CI=true); `.ci/run` installs them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
# Lifetime of a job's launch credential, which is also how long a requeued job waits before it may start again
# (`begin_time = now + cred_expire + 1`, once its old processes have ended): 120 s by default, far longer than a
# test should wait, and long enough on this cluster for slurmd to check a credential under a loaded machine.
CRED_EXPIRE_S = 15


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in ("/usr/sbin", "/sbin") if os.path.exists(f"{d}/{name}")),
                                      None)


def _config(root: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=fedpilot-test", f"SlurmctldHost={host}", f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}", "CredType=cred/munge",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool", f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid", f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
        "ReturnToService=2", "MinJobAge=3600", "KillWait=30", "SchedulerParameters=sched_interval=1",
        f"NodeName={host} CPUs=2 RealMemory=1000 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


def _pid(path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear")
        time.sleep(0.1)
    return int(path.read_text().strip())


def _stop(pid: int) -> None:
    """SIGTERM, then SIGKILL after 10 s: one daemon this fixture started."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """munged, slurmctld and slurmd on this host; the environment the Slurm client commands need (SLURM_CONF)."""
    missing = [b for b in BINARIES if _which(b) is None]
    if missing or os.geteuid() != 0:
        message = (f"Slurm binaries missing ({', '.join(missing)}): install `slurm-wlm` and `munge`" if missing
                   else "the test Slurm cluster runs its daemons as root")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    root = Path(tempfile.mkdtemp(prefix="fp-slurm-"))
    root.chmod(0o755)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_config(root, host))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pids: list[int] = []
    try:
        m = root / "munge"
        subprocess.run([_which("munged"), "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
                        f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
                       check=True, env=env, timeout=30)
        pids.append(_pid(m / "munged.pid"))
        subprocess.run([_which("slurmctld"), "-f", str(conf)], check=True, env=env, timeout=30)
        pids.append(_pid(root / "slurmctld.pid"))
        subprocess.run([_which("slurmd"), "-f", str(conf), "-N", host], check=True, env=env, timeout=30)
        pids.append(_pid(root / "slurmd.pid"))
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if state.strip() == "idle":
                break
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-2000:] for p in (root / "log").glob("*.log"))
                pytest.fail(f"the test Slurm cluster did not come up (sinfo: {state.strip()!r}):\n{logs}")
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf), "root": str(root)}
    finally:
        jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True).stdout.split()
        for job in sorted(set(jobs)):
            subprocess.run(["scancel", job], env=env, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and subprocess.run(
                ["squeue", "-h", "-t", "R,CG,S", "-o", "%A"], env=env, capture_output=True, text=True).stdout.strip():
            time.sleep(0.5)
        for pid in reversed(pids):
            _stop(pid)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The test cluster for this test's commands: SLURM_CONF set, and its defaults for fedpilot (no GPUs)."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster["SLURM_CONF"])
    monkeypatch.setenv("FEDPILOT_SLURM", "gpus=0 cpus=1")
    return slurm_cluster


def squeue(job_id: str) -> str:
    """The Slurm state of a job ('' when the controller does not know it)."""
    done = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                          text=True)
    return done.stdout.strip()
