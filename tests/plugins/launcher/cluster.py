"""A two-"host" cluster on this machine for the multi-node launcher tests.

* :class:`SshCluster`: an ``sshd`` the test starts on a free loopback port, listening on 127.0.0.1
  and 127.0.0.2 (the two hosts), with a host key and a client key generated in a temporary folder,
  its own ``sshd_config`` and an ``ssh_config`` for the clients (``ssh -F``). No system ssh file is
  read or changed (only ``/run/sshd``, sshd's privilege-separation folder, is created when missing).
  127.0.0.3 is a host whose connection is refused, 127.0.0.4 one whose sshd refuses our key and
  127.0.0.5 one that accepts the connection but never answers.
* :class:`SlurmCluster`: ``munged`` with a generated key, ``slurmctld`` and two ``slurmd`` (nodes
  ``n1`` at 127.0.0.1 and ``n2`` at 127.0.0.2) from a generated ``slurm.conf``; clients find it
  through ``SLURM_CONF``.

Each skips (with the reason) when its programs are not installed.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.conftest import free_port

HOSTS = ("127.0.0.1", "127.0.0.2")
REFUSED_HOST = "127.0.0.3"  # nothing listens there: "Connection refused"
DENIED_HOST = "127.0.0.4"  # sshd answers, but not for our key: "Permission denied (publickey)"
SILENT_HOST = "127.0.0.5"  # accepts TCP connections and never speaks ssh: a hung host


def need(*programs: str, package: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian package {package}; .ci/run installs it)")


def _wait_for(predicate, timeout: float, what: str, log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} did not come up within {timeout} s\n{tail}")


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class SshCluster:
    def __init__(self, root: Path):
        need("sshd", "ssh", "ssh-keygen", package="openssh-server, openssh-client")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.silent_port = free_port()
        for name in ("host_key", "client_key", "stranger_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        (root / "authorized_keys").chmod(0o600)
        listen = "\n".join(f"ListenAddress {h}" for h in (*HOSTS, DENIED_HOST))
        (root / "sshd_config").write_text(f"""\
Port {self.port}
{listen}
HostKey {root / 'host_key'}
AuthorizedKeysFile {root / 'authorized_keys'}
PidFile {root / 'sshd.pid'}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
""")
        common = f"""\
  Port {self.port}
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
"""
        self.config = root / "ssh_config"
        # ssh takes the first value it finds for an option, except IdentityFile, which adds up
        self.config.write_text(f"""\
Host {DENIED_HOST}
  IdentityFile {root / 'stranger_key'}
Host {SILENT_HOST}
  Port {self.silent_port}
Host * !{DENIED_HOST}
  IdentityFile {root / 'client_key'}
Host *
{common}""")
        privsep = Path("/run/sshd")
        if not privsep.is_dir():
            if os.geteuid() != 0:
                pytest.skip("sshd needs /run/sshd (its privilege-separation folder), which only root can create")
            privsep.mkdir(mode=0o755, parents=True)
        self.log = root / "sshd.log"
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        subprocess.run([os.path.realpath(sshd), "-f", str(root / "sshd_config"), "-E", str(self.log)], check=True)
        _wait_for(lambda: all(_listening(h, self.port) for h in HOSTS), 15, "sshd", self.log)
        self.silent = socket.socket()
        self.silent.bind((SILENT_HOST, self.silent_port))
        self.silent.listen(64)  # never accepted: the kernel completes the handshake, nobody speaks

    def ssh_args(self) -> List[str]:
        return ["-F", str(self.config)]

    def env(self) -> Dict[str, str]:
        """Environment for pdsh: its ssh reads our client config."""
        return {"PDSH_SSH_ARGS_APPEND": f"-F {self.config}"}

    def hostfile(self, path: Path, hosts=HOSTS, slots: int = 2) -> Path:
        path.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
        return path

    def stop(self) -> None:
        self.silent.close()
        pid_file = self.root / "sshd.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


class SlurmCluster:
    def __init__(self, root: Path):
        need("munged", "slurmctld", "slurmd", "srun", "sinfo", package="slurm-wlm, munge")
        if os.geteuid() != 0:
            pytest.skip("slurmd runs jobs as their user only when started by root")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)  # munged refuses a socket folder others may write
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = root / "munge.sock"
        self.daemons: List[Path] = []
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={self.socket}",
                        f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                        f"--seed-file={root / 'munged.seed'}"], check=True)
        self.daemons.append(root / "munged.pid")
        ctld, n1, n2 = free_port(), free_port(), free_port()
        (root / "state").mkdir()
        (root / "spool").mkdir()
        host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.conf.write_text(f"""\
ClusterName=dsplugtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}/%n
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd'}-%n.pid
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd'}-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.2 Port={n2} CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        env = self.env()
        subprocess.run(["slurmctld", "-i"], env={**os.environ, **env}, check=True)
        self.daemons.append(root / "slurmctld.pid")
        for node in ("n1", "n2"):
            subprocess.run(["slurmd", "-N", node], env={**os.environ, **env}, check=True)
            self.daemons.append(root / f"slurmd-{node}.pid")

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env={**os.environ, **env}, capture_output=True,
                                 text=True).stdout.split()
            return out[:2] == ["idle", "2"]

        _wait_for(idle, 30, "slurm (2 idle nodes)", root / "slurmctld.log")

    def env(self) -> Dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def hostfile(self, path: Path, slots: int = 2) -> Path:
        path.write_text("".join(f"{n} slots={slots}\n" for n in ("n1", "n2")))
        return path

    def stop(self) -> None:
        for pid_file in reversed(self.daemons):
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass


def processes_mentioning(marker: str) -> List[str]:
    """Command lines of the live processes (any "host": they all run here) that contain ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        line = raw.replace(b"\0", b" ").decode(errors="replace")
        if marker in line and state != "Z":
            found.append(f"{pid}: {line}")
    return found


def wait_no_processes(marker: str, timeout: float) -> List[str]:
    """Wait until no process mentions ``marker``; returns those still alive after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    left = processes_mentioning(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_mentioning(marker)
    return left
