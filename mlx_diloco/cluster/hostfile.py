"""MLX's hostfile, as `mlx.distributed_config` writes it and `mlx.launch --hostfile` reads it
(mlx/_distributed_utils/common.py, `Hostfile`): a JSON object

    {"backend": "ring", "envs": ["NAME=value"],
     "hosts": [{"ssh": "mini1", "ips": ["192.168.0.1"], "rdma": [null, "rdma_en2"]}, ...]}

or a bare list of such hosts. The hosts' order is the ranks' order. "ssh" names the machine
(mlx.launch runs rank r there over ssh; here its agent answers there, on the agent port). What
"ips" holds depends on how the file was made: for the ring backend over Thunderbolt, rank r's end
of the cable from rank r-1, where it listens (config.py `configure_ring`); over Ethernet, and in
jaccl files, the Mac's LAN address (rank 0's first one is jaccl's coordinator). "rdma" (jaccl)
has one entry per rank: the device of this host's cable to that rank (rdma_en2 for the port en2),
a list of them (one per cable), or null for itself and for ranks it has no cable to; "jaccl"
needs every pair cabled, "jaccl-ring" each pair of neighbours (launch.py `launch_jaccl`).

`launch --hostfile FILE` takes its machines, ring order, addresses and RDMA devices from such a
file; every start writes the ring it used to RUN/hostfile.json in the same format. MLX-free.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..options import ConfigError, read_json

BACKENDS = ("", "ring", "jaccl", "jaccl-ring")  # what mlx.distributed_config writes ("": --over ethernet)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,252}")    # an ssh destination: [user@]host
_ADDRESS = re.compile(r"[0-9A-Za-z][0-9A-Za-z.:-]{0,63}")  # an IP address or host name
_DEVICE = re.compile(r"[A-Za-z0-9_.-]{1,32}")               # an RDMA device: rdma_en2
MAKE_ONE = "mlx.distributed_config --hosts HOST1,HOST2,... --over thunderbolt --output-hostfile FILE"


@dataclass
class MlxHost:
    ssh: str
    ips: list = field(default_factory=list)
    rdma: list = field(default_factory=list)   # per rank: None, a device name, or a list of names

    @property
    def agent_address(self) -> str:
        """Where this machine's agent answers: the ssh destination without its user."""
        return self.ssh.rpartition("@")[2]


@dataclass
class MlxHostfile:
    hosts: list
    backend: str = ""
    envs: list = field(default_factory=list)

    def to_json(self) -> dict:
        """The file's JSON, key for key as MLX's `Hostfile.to_json`."""
        return {"backend": self.backend, "envs": self.envs,
                "hosts": [{"ssh": h.ssh, "ips": h.ips, "rdma": h.rdma} for h in self.hosts]}

    def write(self, path: Path):
        Path(path).write_text(json.dumps(self.to_json(), indent=4) + "\n")

    @classmethod
    def read(cls, path) -> "MlxHostfile":
        """The hostfile at `path`, or one ConfigError line naming what is wrong in it and the fix."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"hostfile {path} does not exist; make one with {MAKE_ONE.replace('FILE', str(path))}")
        return cls.from_json(read_json(path, "an MLX hostfile", f"make one with {MAKE_ONE}"), str(path))

    @classmethod
    def from_json(cls, data, where: str = "the hostfile") -> "MlxHostfile":
        """The hostfile of JSON `data` (as MLX's `Hostfile.from_file` reads it), checked as
        mlx.launch checks it before it starts anything."""
        def bad(problem, fix=f"make it again with {MAKE_ONE}"):
            raise ConfigError(f"hostfile {where}: {problem}; {fix}")

        hosts, backend, envs = data, "", []
        if isinstance(data, dict):
            if not isinstance(data.get("hosts"), list):
                bad('it has no "hosts" list', 'write {"hosts": [{"ssh": "mini1", "ips": ["10.0.0.1"]}, ...]}')
            hosts, backend, envs = data["hosts"], data.get("backend", ""), data.get("envs", [])
        if not isinstance(hosts, list) or not hosts:
            bad("it lists no hosts", 'write {"hosts": [{"ssh": "mini1", "ips": ["10.0.0.1"]}, ...]}')
        if backend not in BACKENDS:
            bad(f"backend {backend!r} is not one mlx-diloco runs (ring or jaccl)",
                'set "backend" to "ring", "jaccl" or "jaccl-ring", or drop it')
        if not isinstance(envs, list) or not all(isinstance(e, str) for e in envs):
            bad('"envs" must be a list of "NAME=value" strings')
        parsed = []
        for r, h in enumerate(hosts):
            if not isinstance(h, dict) or not isinstance(h.get("ssh"), str) or not _NAME.fullmatch(h["ssh"]):
                bad(f'host {r} has no "ssh" name', 'give each host {"ssh": "NAME", "ips": [...]}')
            ips, rdma = h.get("ips", []), h.get("rdma", [])
            if not isinstance(ips, list) or not all(isinstance(a, str) and _ADDRESS.fullmatch(a) for a in ips):
                bad(f'host {h["ssh"]}: "ips" must be a list of addresses, got {ips!r}')
            if not isinstance(rdma, list) or not all(_is_devices(d) for d in rdma):
                bad(f'host {h["ssh"]}: "rdma" must list null, a device name or a list of names per rank, got {rdma!r}')
            if rdma and len(rdma) != len(hosts):
                bad(f'host {h["ssh"]} lists {len(rdma)} RDMA entries for {len(hosts)} hosts')
            if rdma and rdma[r] is not None:
                bad(f'host {h["ssh"]} lists an RDMA device to itself (entry {r} must be null)')
            parsed.append(MlxHost(h["ssh"], list(ips), list(rdma)))
        seen = [h.agent_address for h in parsed]
        if len(set(seen)) < len(seen):
            twice = next(a for a in seen if seen.count(a) > 1)
            bad(f"{twice} is listed twice (one agent runs one worker)", "list each Mac once")
        file = cls(parsed, backend, list(envs))
        if backend.startswith("jaccl"):
            missing = [(i, j) for i, j in file.pairs(ring=backend == "jaccl-ring") if not file.devices(i, j)]
            if missing:
                i, j = missing[0]
                bad(f"backend {backend} but no RDMA device is listed for {parsed[i].ssh} to {parsed[j].ssh}")
        return file

    def devices(self, i: int, j: int) -> list:
        """The RDMA devices host i lists for its cables to host j ([] if none)."""
        d = self.hosts[i].rdma[j] if len(self.hosts[i].rdma) == len(self.hosts) else None
        return [] if d is None else [d] if isinstance(d, str) else list(d)

    def pairs(self, ring: bool) -> list:
        """(i, j) of every ordered pair of hosts, or (ring) of each host and its two neighbours."""
        n = len(self.hosts)
        return [(i, j) for i in range(n) for j in ({(i - 1) % n, (i + 1) % n} if ring else range(n)) if i != j]

    def index(self, agent_address: str):
        """The rank the file gives the machine whose agent answers at `agent_address` (None: not in it)."""
        return next((r for r, h in enumerate(self.hosts) if h.agent_address == agent_address), None)


def _is_devices(d) -> bool:
    return d is None or (isinstance(d, str) and bool(_DEVICE.fullmatch(d))) or \
        (isinstance(d, list) and bool(d) and all(isinstance(x, str) and _DEVICE.fullmatch(x) for x in d))


def is_device_matrix(devices, n: int) -> bool:
    """Whether `devices` is MLX's device matrix for n ranks (what jaccl reads from MLX_IBV_DEVICES)."""
    return isinstance(devices, list) and len(devices) == n and all(
        isinstance(row, list) and len(row) == n and row[r] is None and all(_is_devices(d) for d in row)
        for r, row in enumerate(devices))


def is_full_mesh(devices: list) -> bool:
    """Whether MLX's device matrix joins every pair of ranks (jaccl's mesh; else at best its ring)."""
    return all(devices[i][j] for i in range(len(devices)) for j in range(len(devices)) if i != j)
