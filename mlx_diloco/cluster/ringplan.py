"""Ordering the ring and choosing each rank's address.

In MLX's ring each rank listens on the address(es) written for it in the hostfile and its left
neighbour connects there. So rank i is best reached on the interface it shares with rank i-1:
a Thunderbolt cable where there is one (the two ends of a cable share a small subnet, as
`mlx.distributed_config --over thunderbolt` assigns), else the LAN address the launcher used.
The order maximises the number of neighbouring pairs joined by Thunderbolt.
"""

import ipaddress
from itertools import permutations

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


def plan_ring(agents: list, lan_addresses: list) -> tuple:
    """-> (order, addresses, links): `order` indexes `agents` by rank; addresses[r] is where rank r
    listens; links[r] is "thunderbolt" or "lan" for the hop from rank r-1 to rank r."""
    n = len(agents)

    def tb_hops(order):
        return sum(thunderbolt_address(agents[order[r]], agents[order[r - 1]]) is not None for r in range(n))

    order = list(range(n))
    if 2 < n <= EXHAUSTIVE_UP_TO:  # keep agent 0 as rank 0; try every order of the rest
        order = max(([0, *rest] for rest in permutations(range(1, n))), key=tb_hops)
    addresses, links = [], []
    for r, a in enumerate(order):
        tb = thunderbolt_address(agents[a], agents[order[r - 1]]) if n > 1 else None
        addresses.append(tb or lan_addresses[a])
        links.append("thunderbolt" if tb else "lan")
    return order, addresses, links
