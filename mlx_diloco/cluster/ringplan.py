"""Ordering the ring and choosing each rank's address.

In MLX's ring each rank listens on the address(es) written for it in the hostfile and its left
neighbour connects there. So rank i is best reached on the interface it shares with rank i-1:
a Thunderbolt cable where there is one (the two ends of a cable share a small subnet, as
`mlx.distributed_config --over thunderbolt` assigns), else the LAN address the launcher used.
When the agents hold a measurement of every pair's link (`mlx-diloco links`, links.py), the order
maximises the slowest hop's bandwidth (then the sum of the hops'); otherwise the number of
neighbouring pairs joined by Thunderbolt.
"""

import ipaddress
from itertools import permutations

from ..records import HOP

EXHAUSTIVE_UP_TO = 8   # hosts; beyond that the given order is kept


def _networks(agent: dict, kind: str) -> dict:
    """{network: address} of the agent's interfaces of `kind`."""
    out = {}
    for i in agent.get("interfaces", []):
        if i["kind"] == kind:
            out[ipaddress.ip_interface(f"{i['address']}/{i['prefix']}").network] = i["address"]
    return out


def thunderbolt_address(agent: dict, neighbour: dict):
    """`agent`'s address on a Thunderbolt subnet it shares with `neighbour`, or None."""
    mine, theirs = _networks(agent, "thunderbolt"), _networks(neighbour, "thunderbolt")
    shared = [net for net in mine if net in theirs]
    return mine[shared[0]] if shared else None


# Interface kinds (hostinfo.py), slowest first: a hop is as slow as the slower of its two ends.
SLOWEST_FIRST = ("wifi", "other", "ethernet", "thunderbolt-bridge", "thunderbolt")


def link_kind(sender: dict, receiver: dict, address: str) -> str:
    """The kind of the link between `sender` and `receiver`, who listens at `address`: on that
    address's network, the slower of the two machines' fastest interfaces there ("other" when not
    found). The same both ways: a Mac with Ethernet and Wi-Fi on one LAN counts as on Ethernet."""
    ends = [i for i in receiver.get("interfaces", []) if i["address"] == address]
    if not ends:
        return "other"
    net = ipaddress.ip_interface(f"{address}/{ends[0]['prefix']}").network
    speed = lambda kind: SLOWEST_FIRST.index(kind) if kind in SLOWEST_FIRST else 1  # noqa: E731
    fastest = [max(kinds, key=speed) for kinds in
               ([i["kind"] for i in agent.get("interfaces", []) if ipaddress.ip_address(i["address"]) in net]
                for agent in (sender, receiver)) if kinds]
    return min(fastest, key=speed)


def measured(a: dict, b: dict, kind: str):
    """The newest measurement the two agents keep of their link (links.py's record: gbps,
    latency_ms, ...), if it was taken over a link of `kind` (a cable since plugged in voids it)."""
    records = [r for r in (a.get("links", {}).get(b.get("id")), b.get("links", {}).get(a.get("id")))
               if r and r.get("kind") == kind]
    return max(records, key=lambda r: r["time"]) if records else None


def plan_ring(agents: list, lan_addresses: list) -> tuple:
    """-> (order, addresses, links): `order` indexes `agents` by rank; addresses[r] is where rank r
    listens; links[r] is "thunderbolt" or "lan" for the hop from rank r-1 to rank r."""
    n = len(agents)

    def tb_hops(order):
        return sum(thunderbolt_address(agents[order[r]], agents[order[r - 1]]) is not None for r in range(n))

    gbps = measured_pairs(agents, lan_addresses)

    def bandwidth(order):  # the slowest hop, then all of them (summed in one order: a ring and its reverse tie)
        hops = sorted(gbps[frozenset((order[r - 1], order[r]))] for r in range(n))
        return hops[0], sum(hops)

    order = list(range(n))
    if 2 < n <= EXHAUSTIVE_UP_TO:  # keep agent 0 as rank 0; try every order of the rest
        order = max(([0, *rest] for rest in permutations(range(1, n))), key=bandwidth if gbps else tb_hops)
    addresses, links = [], []
    for r, a in enumerate(order):
        tb = thunderbolt_address(agents[a], agents[order[r - 1]]) if n > 1 else None
        addresses.append(tb or lan_addresses[a])
        links.append("thunderbolt" if tb else "lan")
    return order, addresses, links


def listen_address(agent: dict, neighbour: dict, lan_address: str) -> str:
    """Where `agent` listens for `neighbour`: on the cable they share, else on the LAN."""
    return thunderbolt_address(agent, neighbour) or lan_address


def measured_pairs(agents: list, lan_addresses: list) -> dict:
    """{frozenset((i, j)): Gbit/s} of every pair of agents from the measurements they keep, or {}
    when a pair has none (of the link it would use now)."""
    gbps = {}
    for i in range(len(agents)):
        for j in range(i + 1, len(agents)):
            kind = link_kind(agents[i], agents[j], listen_address(agents[j], agents[i], lan_addresses[j]))
            record = measured(agents[i], agents[j], kind)
            if record is None:
                return {}
            gbps[frozenset((i, j))] = record["gbps"]
    return gbps


def ring_hops(agents: list, order: list, addresses: list) -> list:
    """Each rank's incoming hop (from rank r-1): {"kind", "gbps", "latency_ms"}, the last two from
    the pair's kept measurement (None without one, and for a ring of one)."""
    hops = []
    for r, a in enumerate(order):
        sender, receiver = agents[order[r - 1]], agents[a]
        kind = link_kind(sender, receiver, addresses[r]) if len(order) > 1 else None
        record = measured(sender, receiver, kind) if len(order) > 1 else None
        hops.append({HOP.kind: kind, HOP.gbps: record and record["gbps"], HOP.latency_ms: record and record["latency_ms"]})
    return hops
