"""Measured links (`mlx-diloco links`, `launch --measure-links`): the sizes of a link test, its
bandwidths, the job file an agent writes for it and the record it keeps of the link.

A link test is a two-process MLX ring between two machines, over the address the job's ring would
use (the cable where the two share one, else the LAN): exchange/linktest.py times the ops, and
linktests.py runs one per pair of agents. Bandwidths are nccl-tests' (PERFORMANCE.md there):
algorithm bandwidth algbw = bytes / time; bus bandwidth busbw = algbw * 2(n-1)/n for an
all-reduce (what each link carries, comparable to the link's rate) and algbw for a send/recv. A
link's bandwidth is the all-reduce busbw of the largest sizes measured (what an exchange gets),
its latency half the round trip of the smallest send/recv. Both agents keep the result, in
STATE/links/PEER_ID.json: `discover` shows it, the launcher orders the ring by it (ringplan.py)
and `plan --cluster` estimates with the slowest hop of that ring.

MLX-free: the agent imports it.
"""

import re
import time
from dataclasses import dataclass

from ..options import ConfigError
from ..worker_job import JobFile

SMALLEST = 1 << 10          # bytes: the first size, where latency dominates
MAX_SIZE = 256 << 20        # bytes: the default largest size
MAX_OP_S = 0.25             # s: no larger size once an all-reduce takes this long (the rate dominates)
GROWTH = 4                  # each size is 4x the one before: 1 KB, 4 KB, ... 256 MB


def parse_size(text: str) -> int:
    """'256MB', '4M', '1KB', '65536' -> bytes (K, M, G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text.lower())
    if not m:
        raise ConfigError(f"bad size '{text}'; write bytes or a number with K, M or G, like 256MB")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def sizes(max_size: int = MAX_SIZE) -> list:
    """The message sizes of a link test: 1 KB, 4 KB, ... up to max_size (at least 1 KB)."""
    if max_size < SMALLEST:
        raise ConfigError(f"--max-size must be at least 1KB, got {max_size} bytes")
    out = [SMALLEST]
    while out[-1] * GROWTH <= max_size:
        out.append(out[-1] * GROWTH)
    return out


def algbw_gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def busbw_gbps(op: str, nbytes: int, seconds: float, ranks: int = 2) -> float:
    """nccl-tests' bus bandwidth: an all-reduce moves 2(n-1)/n of the data over each link."""
    return algbw_gbps(nbytes, seconds) * (2 * (ranks - 1) / ranks if op == "all_reduce" else 1.0)


def row(op: str, sender, nbytes: int, seconds: float) -> dict:
    """One measurement: op "all_reduce" or "send_recv" (sender: the rank that sent), its size and time."""
    return {"op": op, "from": sender, "bytes": nbytes, "seconds": seconds,
            "algbw_gbps": algbw_gbps(nbytes, seconds), "busbw_gbps": busbw_gbps(op, nbytes, seconds)}


def summarize(rows: list) -> dict:
    """A link from its rows: gbps (the all-reduce busbw), sendrecv_gbps (the slower direction's),
    latency_ms (half the smallest send/recv's round trip) and the largest size measured. The
    bandwidths are the better of the two largest sizes: the rate dominates there (at small sizes
    the latency does, and on an emulated link a token bucket), and one of them slowed down by other
    work on the machines does not set it."""
    by_size = {}
    for r in rows:
        by_size.setdefault(r["bytes"], []).append(r)
    large = [by_size[n] for n in sorted(by_size)[-2:]]
    reduce = [r["busbw_gbps"] for same in large for r in same if r["op"] == "all_reduce"]
    sends = [min(r["busbw_gbps"] for r in same if r["op"] == "send_recv") for same in large]
    trips = [r["seconds"] for r in by_size[min(by_size)] if r["op"] == "send_recv"]
    return {"gbps": max(reduce), "sendrecv_gbps": max(sends), "latency_ms": sum(trips) / len(trips) / 2 * 1e3,
            "bytes": max(by_size)}


# ---------------------------------------------------------------- the link test's job (agent -> linktest)

FIX = "pass the job file an agent wrote (mlx-diloco links starts link tests through the agents)"


@dataclass(frozen=True)
class LinkTestJob(JobFile):
    WHAT, KEY, FIX = "link test job", "link test key", FIX
    sizes: list                    # message sizes in bytes, smallest first
    collective_timeout: float      # s one op may wait for the peer before the test exits
    rows: str                      # JSON lines, one per measurement (the agent's status returns them)
    keep: str                      # this machine's record of the link, rewritten at the end
    peer: dict                     # the machine at the other end: {"id", "host"}
    kind: str                      # the link's kind (ringplan.link_kind)
    max_op_s: float = MAX_OP_S


def kept_record(rows: list, job: LinkTestJob) -> dict:
    """What an agent keeps of its link to the peer (and reports in its hello)."""
    return {"peer": job.peer["id"], "peer_host": job.peer["host"], "kind": job.kind, **summarize(rows),
            "time": time.time()}


def describe(record: dict) -> str:
    """One line of a kept record, for `discover`."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record["time"]))
    return (f"link to {record['peer_host']}: {record['kind']} {record['gbps']:.3g} Gbit/s (send/recv "
            f"{record['sendrecv_gbps']:.3g}), latency {record['latency_ms']:.3g} ms, up to "
            f"{record['bytes'] >> 10:,} KB, measured {when}")
