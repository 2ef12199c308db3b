"""An emulated cluster for tests and benches: hosts as Linux network namespaces (the operator's
cluster/netns-cluster.sh, in a source checkout), each running a real `mlx-diloco agent`. Needs
root; CI runs as root. A test harness, not for real clusters: its agents share the SECRET below,
and listen only inside the namespaces it makes.

Several clusters may run on one machine at once (two checkouts' test runs, a bench beside them):
each takes namespaces and a /24 that no other holds (chosen under a lock), and each process its
own secret, so a launcher that finds another run's agents over mDNS cannot drive them."""

import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .discovery import AgentClient, Found
from .protocol import DEFAULT_PORT as PORT, NO_LOG

SCRIPT = Path(__file__).resolve().parents[2] / "cluster" / "netns-cluster.sh"

SECRET = f"test-cluster-{secrets.token_hex(16)}"  # this process's clusters' (a test run's, a bench's)
LOCK = Path("/run/mlx-diloco-emulated-cluster.lock")  # held while a cluster picks its names and builds its bridge
# A cluster's hosts: SUBNET.11, .12, ... Not 10.77.0, netns-cluster.sh's default for a cluster made by
# hand (and every emulated cluster's before issue 36: an older checkout's tests may hold it unchecked).
SUBNETS = [f"10.77.{n}" for n in range(1, 256)]


def can_build() -> str:
    """'' if this machine can build namespaces, else why not."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if not shutil.which("ip"):
        return "the 'ip' command (iproute2) is missing"
    if not SCRIPT.is_file():
        return f"{SCRIPT} is missing: the emulated cluster runs from a source checkout"
    return ""


def _taken() -> tuple:
    """(the /24s this machine's interfaces hold, the names of its interfaces and network namespaces)."""
    def names(*command):
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.split("\n")
    subnets = {line.split()[3].rsplit(".", 1)[0] for line in names("ip", "-o", "-4", "addr", "show") if line.strip()}
    links = {line.split(": ")[1].split("@")[0] for line in names("ip", "-o", "link", "show") if line.strip()}
    return subnets, links | {line.split()[0] for line in names("ip", "netns", "list") if line.strip()}


def _free_place(subnet: str = None) -> tuple:
    """(namespace prefix, subnet) for a new cluster: names no interface or namespace has, and the first
    /24 of SUBNETS that no interface holds (or `subnet`: netns-cluster.sh refuses it if one does)."""
    subnets, names = _taken()
    free = [n for n, candidate in enumerate(SUBNETS) if not any(name.startswith(f"md{n}x") for name in names)
            and (subnet or candidate not in subnets)]
    if not free:
        raise RuntimeError(f"no free subnet for an emulated cluster among {SUBNETS[0]}-{SUBNETS[-1]}.0/24; remove "
                           "leftover clusters (MLXD_NETNS_PREFIX=PREFIX cluster/netns-cluster.sh down)")
    return f"md{free[0]}x", subnet or SUBNETS[free[0]]  # hosts md{n}x1, md{n}x2, ...; bridge md{n}xbr0


class EmulatedCluster:
    """`hosts` namespaces on a bridge shaped at `rate` (each host's sending side), and `cables`:
    {(i, j): rate} direct links, Thunderbolt to the agents (netns-cluster.sh's `cable`). It takes a
    free /24 (or `subnet`, refused if another interface holds it) and names of its own, so clusters
    may run at the same time; `mdns=False` keeps its agents off mDNS: pass `hosts_flag`. Its agents
    load model folders from `models_dir` (agent --models-dir) and their Hugging Face caches, and take
    `agent_flags` (--allow-code)."""

    def __init__(self, hosts: int, folder: Path, rate: str = "", delay: str = "", max_memory: dict = None,
                 host_env: dict = None, cables: dict = None, subnet: str = None, mdns: bool = True,
                 models_dir: Path = None, agent_flags: list = ()):
        self.folder, self.n, self.mdns, self.models_dir = Path(folder), hosts, mdns, models_dir
        self.agent_flags = list(agent_flags)
        self.max_memory = max_memory or {}  # host -> GB its agent offers (agent --max-memory)
        self.host_env = host_env or {}      # host -> its agent's own variables (HF_HUB_CACHE: its own model cache)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.agents = {}
        with open(LOCK, "a") as lock:  # another cluster picking now must see this one's bridge
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.prefix, self.subnet = _free_place(subnet)
            # The hosts share this machine's cores: give each its share of BLAS threads, as on real machines.
            threads = str(max(1, (os.cpu_count() or 1) // hosts))
            self.env = {**os.environ, "MLXD_NETNS_PREFIX": self.prefix, "MLXD_SUBNET": self.subnet,
                        "MLX_DILOCO_SECRET": SECRET, "OPENBLAS_NUM_THREADS": threads}
            self._script("up", str(hosts), rate, delay)
        for (i, j), cable_rate in (cables or {}).items():
            self._script("cable", str(i), str(j), cable_rate)
        for i in range(1, hosts + 1):
            self.start_agent(i, wait=False)
        for i in range(1, hosts + 1):
            self.wait_ready(i)

    def _script(self, *args):
        done = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"netns-cluster.sh {' '.join(filter(None, args))}: {done.stderr.strip() or done.returncode}")

    def namespace(self, i: int) -> str:
        """Host i's network namespace (`ip netns exec NAME ...` runs a command on it)."""
        return f"{self.prefix}{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    @property
    def hosts_flag(self) -> str:
        return ",".join(f"{self.address(i)}:{PORT}" for i in range(1, self.n + 1))

    def start_agent(self, i: int, wait: bool = True):
        log = open(self.folder / f"agent-host{i}.log", "a")
        self.agents[i] = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(i), sys.executable, "-m", "mlx_diloco", "agent", "--name",
             f"host{i}", "--port", str(PORT), "--state-dir", str(self.folder / f"host{i}"),
             *([] if self.mdns else ["--no-mdns"]), *(["--models-dir", str(self.models_dir)] if self.models_dir else []),
             *(["--max-memory", str(self.max_memory[i])] if i in self.max_memory else []), *self.agent_flags],
            stdout=log, stderr=subprocess.STDOUT, env={**self.env, **self.host_env.get(i, {})},
            cwd=self.folder)  # not a source checkout: `-m mlx_diloco` finds the package its PYTHONPATH names
        if wait:
            self.wait_ready(i)

    def wait_ready(self, i: int):
        deadline = time.time() + 60
        while "ready on port" not in (self.folder / f"agent-host{i}.log").read_text():
            assert self.agents[i].poll() is None and time.time() < deadline, \
                (self.folder / f"agent-host{i}.log").read_text()
            time.sleep(0.2)

    def kill_host(self, i: int):
        """The machine drops out: every process in its namespace dies at once."""
        pids = subprocess.run(["ip", "netns", "pids", self.namespace(i)], capture_output=True, text=True).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        self.agents[i].wait()

    def job_folder(self, i: int) -> Path:
        """Host i's training job's folder (its agent's link tests have folders beside it)."""
        return next(p for p in (self.folder / f"host{i}" / "jobs").iterdir() if (p / "job.json").exists())

    def progress(self, i: int):
        try:
            return json.loads((self.job_folder(i) / "progress.json").read_text())
        except (OSError, StopIteration, ValueError):
            return None

    def worker_pid(self, i: int) -> int:
        client = AgentClient(Found(self.address(i), PORT), SECRET.encode())
        return client.request("status", job=self.job_folder(i).name, metrics_from=0, exchanges_from=NO_LOG, log_from=NO_LOG)["pid"]

    def close(self):
        for p in self.agents.values():
            if p.poll() is None:
                p.terminate()
        for p in self.agents.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self._script("down")
