"""Which MLX backend a start of the job runs on, over which ring: MLX's ring (TCP, always possible)
or jaccl (RDMA over Thunderbolt 5, MLX's `mx.distributed.init(backend="jaccl")`).

jaccl needs on every member macOS 26.2 or later, MLX 0.30.1 or later, RDMA enabled once in macOS
Recovery (`rdma_ctl enable`), and an RDMA device whose port is active on each cable it uses (rdma_en2
on the cable at en2). MLX's jaccl reads a device matrix, one row per rank and one entry per peer:
with a device for every pair of ranks (a full mesh of cables) it runs its mesh group, with one for
each pair of ring neighbours its ring group (jaccl.cpp `init`). So jaccl needs the neighbours of
the ring cabled; a full mesh is better for latency, not required.

`--backend auto` takes jaccl when that holds and the ring otherwise, and says which and why;
`--backend jaccl` that cannot be met is one ConfigError line naming what is missing and the fix.
The devices come from the agents' reports (hostinfo: Thunderbolt links and `ibv_devinfo`), or
from an MLX hostfile (`launch --hostfile`, hostfile.py), whose order and addresses then make the
ring. MLX-free: the launcher and `launch --dry-run` run it.
"""

import re
from dataclasses import dataclass

from ..options import ConfigError
from .hostfile import MlxHost, MlxHostfile, is_full_mesh
from .ringplan import thunderbolt_address

BACKENDS = ("auto", "ring", "jaccl")
JACCL_MACOS = (26, 2)    # RDMA over Thunderbolt 5 arrived in macOS 26.2 (Apple's TN3205)
JACCL_MLX = (0, 30, 1)   # the first MLX release with jaccl
NEEDS = "jaccl needs macOS 26.2+ with RDMA over Thunderbolt 5"
ENABLE = "enable RDMA once: `rdma_ctl enable` in macOS Recovery, then reboot"
SYSTEMS = {"linux": "Linux", "win32": "Windows", "darwin": "macOS"}


def _version(text: str) -> tuple:
    """(26, 2) for "26.2", (0, 30, 1) for "0.30.1.dev0"; () for ""."""
    found = re.match(r"\d+(\.\d+)*", text or "")
    return tuple(int(p) for p in found.group().split(".")) if found else ()


# ---------------------------------------------------------------- RDMA devices from the agents' reports

def cables(agent: dict, peer: dict) -> list:
    """[(agent's interface, peer's interface)] of each Thunderbolt cable between the two, in the
    order of the agent's ports (both sides list a pair's cables in this one order: jaccl pairs the
    k-th device of one side with the k-th of the other)."""
    peer_port = {link["domain_uuid"]: link.get("interface") for link in peer.get("thunderbolt", [])}
    return [(link.get("interface"), peer_port[link["peer_uuid"]]) for link in agent.get("thunderbolt", [])
            if link.get("peer_uuid") in peer_port and link.get("interface") and peer_port[link["peer_uuid"]]]


def device_matrix(agents: list) -> list:
    """MLX's device matrix for the ring `agents` (by rank) from their Thunderbolt links: entry (r, s)
    the devices of r's cables to s, as mlx.distributed_config names them (rdma_ and the interface),
    None without a cable. Every pair keeps as many cables as the pair of ring neighbours with the
    fewest (jaccl's ring wants the same number on each), at least one."""
    n = len(agents)
    pairs = {(r, s): cables(agents[r], agents[s]) for r in range(n) for s in range(r + 1, n)}
    neighbours = [pairs[min(r, (r - 1) % n), max(r, (r - 1) % n)] for r in range(n)] if n > 1 else []
    keep = max(1, min((len(found) for found in neighbours), default=1))
    devices = [[None] * n for _ in range(n)]
    for (r, s), found in pairs.items():
        if found:
            mine, theirs = [f"rdma_{a}" for a, _ in found[:keep]], [f"rdma_{b}" for _, b in found[:keep]]
            devices[r][s], devices[s][r] = (mine[0], theirs[0]) if keep == 1 else (mine, theirs)
    return devices


def _listed(entry) -> list:
    return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


# ---------------------------------------------------------------- the choice

def machine_problem(a: dict):
    """Why the machine of hello `a` cannot run jaccl at all, or None (its links are another matter)."""
    host, system = a.get("host", "?"), a.get("platform", "?")
    if system != "darwin":
        return f"{host} runs {SYSTEMS.get(system, system)} ({NEEDS})"
    if _version(a.get("macos", "")) < JACCL_MACOS:
        return f"{host} runs macOS {a.get('macos') or '(version unknown)'} ({NEEDS}: update macOS)"
    if _version(a.get("mlx", "")) < JACCL_MLX:
        return f"{host} has MLX {a.get('mlx') or '(none)'} (jaccl needs MLX 0.30.1+: pip install -U mlx there)"
    if not a.get("rdma"):
        return f"{host} has no RDMA device ({NEEDS}: {ENABLE})"
    return None


def jaccl_problem(agents: list, devices: list):
    """Why jaccl cannot run this ring (`agents` and MLX's `devices` matrix, by rank), or None."""
    for a in agents:
        if problem := machine_problem(a):
            return problem
    n = len(agents)
    for r in range(n):
        s = (r - 1) % n  # the neighbour r receives from; each pair of neighbours once per rank
        for x, y in ((s, r), (r, s)):
            listed = _listed(devices[x][y])
            if not listed:
                return (f"no RDMA link between ring neighbours {agents[x]['host']} and {agents[y]['host']} ({NEEDS} "
                        "between each pair of neighbours: cable them, or order the ring along the cables)")
            for d in listed:
                state = agents[x]["rdma"].get(d)
                if state is None:
                    return (f"{agents[x]['host']} has no RDMA device {d} (its cable to {agents[y]['host']}); "
                            f"it has {', '.join(sorted(agents[x]['rdma']))}: make the hostfile again")
                if state != "PORT_ACTIVE":
                    return (f"{d} on {agents[x]['host']} (cable to {agents[y]['host']}) is {state}: "
                            f"RDMA must be enabled on both Macs ({ENABLE})")
    return None


def choose_backend(requested: str, agents: list, devices: list) -> tuple:
    """-> (backend, reason) for the ring `agents` (by rank) with MLX's device matrix `devices`."""
    if requested not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if len(agents) < 2:
        return "ring", "one worker: no peer to exchange with"
    if requested == "ring":
        return "ring", "asked for (--backend ring)"
    problem = jaccl_problem(agents, devices)
    if problem is None:
        cabled = "a full mesh of RDMA links" if is_full_mesh(devices) else "an RDMA link between ring neighbours"
        return "jaccl", f"every Mac runs macOS 26.2+ with RDMA, with {cabled}"
    if requested == "jaccl":
        raise ConfigError(f"--backend jaccl cannot run here: {problem}; fix that, or pass --backend auto "
                          "(it falls back to the ring)")
    return "ring", problem


# ---------------------------------------------------------------- a start's plan

@dataclass
class Plan:
    """A start's ring and the backend over it, everything by rank."""
    order: list       # indexes into the agents
    hosts: list       # each rank's machine as ssh names it (the hostfile's "ssh")
    addresses: list   # the addresses each rank listens on in MLX's ring
    links: list       # "thunderbolt" or "lan": the hop from rank r-1 to rank r
    lan: list         # an address of each rank every machine reaches (rank 0's: jaccl's coordinator)
    devices: list     # MLX's RDMA device matrix
    backend: str
    reason: str

    def mlx_hostfile(self, envs: list = ()) -> MlxHostfile:
        """This ring as an MLX hostfile, as mlx.distributed_config would write it, so that
        `mlx.launch --hostfile` runs on the same ring: a ring file lists where each rank listens;
        a jaccl file each Mac's LAN address (rank 0's is the coordinator) and its devices."""
        if self.backend == "ring":
            return MlxHostfile([MlxHost(h, list(a), []) for h, a in zip(self.hosts, self.addresses)], "ring", list(envs))
        return MlxHostfile([MlxHost(h, [lan], row) for h, lan, row in zip(self.hosts, self.lan, self.devices)],
                           "jaccl" if is_full_mesh(self.devices) else "jaccl-ring", list(envs))

    def describe(self, agents: list) -> str:
        """What a start does, for `launch --dry-run`: the backend and why, and each rank."""
        lines = [f"backend {self.backend}: {self.reason}"]
        for r, a in enumerate(self.order):
            rdma = ", ".join(f"{agents[self.order[s]]['host']} {'+'.join(_listed(d))}"
                             for s, d in enumerate(self.devices[r]) if d)
            lines.append(f"  rank {r}: {agents[a]['host']} ({self.hosts[r]})  listens on {', '.join(self.addresses[r])}"
                         f" ({self.links[r]} from rank {(r - 1) % len(self.order)})  rdma: {rdma or 'none'}")
        return "\n".join(lines)


def _thunderbolt_addresses(agent: dict) -> set:
    return {i["address"] for i in agent.get("interfaces", []) if i["kind"] == "thunderbolt"}


def plan(requested: str, agents: list, lan_addresses: list, ring: tuple, mlx_file: MlxHostfile = None) -> Plan:
    """The plan of a start. `ring`: (order, addresses, links) as ringplan.plan_ring made it from the
    agents' Thunderbolt links; with an MLX hostfile its order, addresses and devices count instead:
    its machines in its order (others after them), each listening on the file's ips while its ring
    predecessor is the file's (else on its Thunderbolt address to the new one, else its LAN one)."""
    if mlx_file is None:
        order, addresses, links = ring
        ordered = [agents[i] for i in order]
        devices = device_matrix(ordered)
        lan = [lan_addresses[i] for i in order]
        backend, reason = choose_backend(requested, ordered, devices)
        return Plan(list(order), lan, [[a] for a in addresses], list(links), lan, devices, backend, reason)
    rank_in_file = [mlx_file.index(address) for address in lan_addresses]
    n_file = len(mlx_file.hosts)
    order = sorted(range(len(agents)), key=lambda i: (rank_in_file[i] is None, rank_in_file[i] or 0, i))
    ordered, files = [agents[i] for i in order], [rank_in_file[i] for i in order]
    hosts = [mlx_file.hosts[f].ssh if f is not None else lan_addresses[i] for i, f in zip(order, files)]
    lan, addresses = [], []
    for r, (i, f) in enumerate(zip(order, files)):
        ips = mlx_file.hosts[f].ips if f is not None else []
        lan_ips = ips if mlx_file.backend.startswith("jaccl") or mlx_file.backend == "" else []
        lan.append((lan_ips or [lan_addresses[i]])[0])
        prev = files[r - 1]
        if ips and mlx_file.backend in ("", "ring") and f is not None and prev == (f - 1) % n_file:
            addresses.append(list(ips))  # the file's ring: where MLX's ring would listen
        else:
            tb = thunderbolt_address(ordered[r], ordered[r - 1]) if len(order) > 1 else None
            addresses.append([tb or lan[-1]])
    links = ["thunderbolt" if set(a) & _thunderbolt_addresses(agent) else "lan" for a, agent in zip(addresses, ordered)]
    if any(h.rdma for h in mlx_file.hosts):
        devices = [[mlx_file.hosts[f].rdma[g] if f is not None and g is not None and f != g
                    and len(mlx_file.hosts[f].rdma) == len(mlx_file.hosts) else None for g in files] for f in files]
    else:
        devices = device_matrix(ordered)
    backend, reason = choose_backend(requested, ordered, devices)
    return Plan(order, hosts, addresses, links, lan, devices, backend, reason)


def start_fields(p: Plan, rank0_port: int) -> dict:
    """What the agents' start request carries for the backend: for jaccl, MLX's device matrix and
    the coordinator (rank 0's LAN address, on the port its agent reserved for the job)."""
    if p.backend == "ring":
        return {}
    return {"devices": p.devices, "coordinator": f"{p.lan[0]}:{rank0_port}"}
