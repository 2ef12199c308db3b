"""Running link tests across a cluster (`mlx-diloco links`, `launch --measure-links`, `plan
--cluster`): every pair of agents in turn, so that no two tests share a machine's link; each pair's
two agents start their ends (links.py has what a test measures and what they keep), and this
waits for both and reads rank 0's rows. M machines make M(M-1)/2 pairs: every pair that could be
ring neighbours, which is what ordering the ring by measurements needs.
"""

import json
import time

from ..exchange.network import Link
from ..options import ConfigError
from . import protocol
from .discovery import AgentError, reach
from .links import MAX_SIZE, sizes, summarize
from .ringplan import link_kind, listen_address, measured_pairs, plan_ring, ring_hops


class LinkTestFailed(Exception):
    pass


def measure_pair(clients: list, agents: list, lan_addresses: list, message_sizes: list, timeout_s: float) -> dict:
    """The link test between two agents: both start their side, and this waits for both to end (one
    that fails stops the other). Returns {"hosts", "kind", "rows", **summarize(rows)}; LinkTestFailed
    if a side fails."""
    job = f"links-{agents[0]['id'][:8]}-{agents[1]['id'][:8]}"
    addresses = [listen_address(agents[r], agents[1 - r], lan_addresses[r]) for r in (0, 1)]
    kind = link_kind(agents[0], agents[1], addresses[1])
    ports = [c.request("prepare", job=job)["port"] for c in clients]
    hostfile = [[f"{a}:{p}"] for a, p in zip(addresses, ports)]

    def stop():
        for c in clients:
            try:
                c.request("stop", job=job)
            except AgentError:
                pass
    # Each side gives up past its watchdog; this waits a little longer than both, then stops them.
    allowed = max(30.0, timeout_s) * (len(message_sizes) + 2)
    deadline = time.time() + allowed
    try:
        for rank, client in enumerate(clients):  # a side that refuses must not leave the other running
            other = agents[1 - rank]
            client.request("measure_link", job=job, rank=rank, hostfile=hostfile, sizes=message_sizes, link_kind=kind,
                           peer={"id": other["id"], "host": other["host"]}, collective_timeout=float(timeout_s))
        while True:
            states = [c.request("status", job=job, metrics_from=0, exchanges_from=protocol.NO_LOG,
                                log_from=protocol.NO_LOG) for c in clients]
            if any(s["state"] == "unknown" for s in states):
                raise LinkTestFailed(f"an agent of {agents[0]['host']} - {agents[1]['host']} lost the link test "
                                     "(it restarted?); run mlx-diloco links again")
            if any(s["state"] == "exited" and s["returncode"] != 0 for s in states) or \
                    all(s["state"] == "exited" for s in states):
                break
            if time.time() > deadline:
                raise LinkTestFailed(f"the link test {agents[0]['host']} - {agents[1]['host']} did not end in "
                                     f"{allowed:.0f} s")
            time.sleep(0.2)
    except (AgentError, LinkTestFailed):
        stop()
        raise
    hosts = [a["host"] for a in agents]
    for host, s in zip(hosts, states):
        if s["state"] == "exited" and s["returncode"] != 0:
            stop()
            last = (s["log_tail"].strip().splitlines() or ["(no output)"])[-1]
            raise LinkTestFailed(f"the link test on {host} exited with code {s['returncode']}: {last}")
    rows = [json.loads(line) for line in states[0]["metrics"]]  # the two sides report the same rows
    return {"hosts": hosts, "kind": kind, "rows": rows, **summarize(rows)}


def _reach(found: list, secret: bytes, timeout_s: float, log) -> tuple:
    """(clients, hellos, addresses) of the agents in `found` that answer (at least two)."""
    reachable, agents, clients = reach(found, secret, timeout_s=timeout_s, log=lambda m: log(f"[links] {m}"))
    lan = [f.address for f in reachable]
    if len(agents) < 2:
        raise ConfigError(f"{len(agents)} agent(s) answered: a link needs two; start more agents or pass --hosts")
    return clients, agents, lan


def measure_all(found: list, secret: bytes, max_size: int = MAX_SIZE, timeout_s: float = 30.0, log=print) -> dict:
    """Measure every pair of the agents in `found`, one pair at a time. Returns {"pairs": a
    measure_pair result (or {"hosts", "error"}) per pair, "agents": their hellos afterwards (with the
    new records), "order", "hops": the ring they make (ringplan), "measured": whether the
    measurements ordered it (every pair has one)}."""
    clients, agents, lan = _reach(found, secret, timeout_s, log)
    pairs = []
    for i in range(len(agents)):
        for j in range(i + 1, len(agents)):
            log(f"[links] {agents[i]['host']} - {agents[j]['host']} ...")
            try:
                pairs.append(measure_pair([clients[i], clients[j]], [agents[i], agents[j]], [lan[i], lan[j]],
                                          sizes(max_size), timeout_s))
            except (LinkTestFailed, AgentError) as e:
                log(f"[links] {agents[i]['host']} - {agents[j]['host']} failed: {e}")
                pairs.append({"hosts": [agents[i]["host"], agents[j]["host"]], "error": str(e)})
    agents = [c.hello() for c in clients]  # their records, new
    for c in clients:
        c.close()
    order, addresses, _ = plan_ring(agents, lan)
    return {"pairs": pairs, "agents": agents, "order": order, "hops": ring_hops(agents, order, addresses),
            "measured": bool(measured_pairs(agents, lan))}


def cluster_link(found: list, secret: bytes, log=print) -> tuple:
    """(Link, workers) for `plan --cluster`: the slowest hop, by the agents' kept measurements, of the
    ring the launcher would make of them, and how many they are."""
    clients, agents, lan = _reach(found, secret, 10.0, log)
    for c in clients:
        c.close()
    order, addresses, _ = plan_ring(agents, lan)
    hops = ring_hops(agents, order, addresses)
    names = [agents[i]["host"] for i in order]
    for r, hop in enumerate(hops):
        if hop["gbps"] is None:
            raise ConfigError(f"no measurement of the {hop['kind']} link {names[r - 1]} -> {names[r]}: run "
                              "'mlx-diloco links' first, or pass --link")
    r = min(range(len(hops)), key=lambda r: hops[r]["gbps"])
    three_digits = lambda x: float(f"{x:.3g}")  # noqa: E731
    return Link(f"measured {names[r - 1]}->{names[r]} ({hops[r]['kind']})", three_digits(hops[r]["gbps"] * 1e9),
                three_digits(hops[r]["latency_ms"] / 1e3)), len(agents)


def pair_summaries(measured: dict) -> list:
    """measure_all's pairs without their rows, rounded (the launcher's event)."""
    keys = ("kind", "gbps", "sendrecv_gbps", "latency_ms", "error")
    return [{"hosts": p["hosts"], **{k: round(p[k], 4) if isinstance(p[k], float) else p[k] for k in keys if k in p}}
            for p in measured["pairs"]]


def table(measured: dict) -> list:
    """`links`'s output: a line per pair, and the ring the launcher would choose."""
    lines = [f"{'pair':32} {'kind':12} {'all-reduce':>12} {'send/recv':>12} {'latency':>10}  largest size"]
    for p in measured["pairs"]:
        pair = " - ".join(p["hosts"])
        if "error" in p:
            lines.append(f"{pair:32} failed: {p['error']}")
            continue
        lines.append(f"{pair:32} {p['kind']:12} {p['gbps']:>7.3g} Gb/s {p['sendrecv_gbps']:>7.3g} Gb/s "
                     f"{p['latency_ms']:>7.3g} ms  {p['bytes'] >> 10:,} KB")
    lines.append("(the better of the two largest sizes: all-reduce bus bandwidth, nccl-tests' busbw; send/recv: "
                 "the slower direction; latency: one way, half the smallest round trip)")
    lines.append(ring_line(measured["agents"], measured["order"], measured["hops"], measured["measured"]))
    return lines


def ring_line(agents: list, order: list, hops: list, by_measurements: bool) -> str:
    """'ring: a -> c -> b -> d -> a, slowest hop 0.95 Gbit/s (b -> d)', or what ordered it instead."""
    names = [agents[i]["host"] for i in order]
    ring = " -> ".join(names + names[:1])
    if not by_measurements:
        return f"ring: {ring} (ordered by Thunderbolt cables: not every pair has a measurement)"
    gbps, a, b = min((h["gbps"], names[r - 1], names[r]) for r, h in enumerate(hops) if h["gbps"] is not None)
    return f"ring: {ring}, slowest hop {gbps:.3g} Gbit/s ({a} -> {b})"
