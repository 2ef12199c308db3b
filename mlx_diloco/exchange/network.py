"""A model of the links between Macs, for time estimates of runs and for `mlx-diloco plan`.

Ring all-reduce over M workers: 2(M-1) steps, each moving 1/M of the payload and paying the
link latency once. Ring all-gather: M-1 steps, each moving one worker's payload. The quantized
ring: 2(M-1) steps of one encoded chunk. comm.exchange_plan says which one an exchange uses.
"""

import re
from dataclasses import dataclass

from ..options import ConfigError


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_bps: float   # bits per second, per direction
    latency_s: float       # one-way

    def describe(self) -> str:
        return f"{self.name} ({format_bits(self.bandwidth_bps)}/s, {self.latency_s * 1e3:g} ms)"


# Measured or typical IP throughput, not the marketing number (see REFERENCE.md).
LINKS = {
    "tb5": Link("Thunderbolt 5", 60e9, 0.0005),
    "tb4": Link("Thunderbolt 4", 20e9, 0.0005),
    "10gbe": Link("10 GbE", 9.4e9, 0.0002),
    "1gbe": Link("1 GbE", 0.94e9, 0.0003),
    "wifi": Link("Wi-Fi", 0.4e9, 0.010),
    "internet": Link("home internet", 100e6, 0.020),
    "datacenter": Link("data center", 200e9, 0.00001),
}

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def format_bits(bps: float) -> str:
    for unit, scale in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit"


def parse_link(text: str) -> Link:
    """A preset name, or 'BANDWIDTH[/LATENCY]' such as '100mbit/20ms' or '1gbit'."""
    key = text.lower().strip()
    if key in LINKS:
        return LINKS[key]
    m = re.fullmatch(r"([\d.]+)\s*([kmgt]?)(?:bit|b)(?:ps|/s)?(?:\s*/\s*([\d.]+)\s*(ms|us|s))?", key)
    if not m:
        raise ConfigError(f"unknown link '{text}'; choose one of {', '.join(LINKS)} "
                          "or give bandwidth[/latency] like '100mbit/20ms'")
    bw = float(m.group(1)) * _UNITS[m.group(2)]
    lat = float(m.group(3) or 0) * {"ms": 1e-3, "us": 1e-6, "s": 1.0, None: 0}[m.group(4)]
    return Link(text, bw, lat)


def exchange_time(hops: int, sent_bytes: float, link: Link) -> float:
    """A ring algorithm's time: `hops` sequential steps each paying the latency, and the bytes one
    worker sends at the link's bandwidth (every worker sends at once, on its own link)."""
    return hops * link.latency_s + sent_bytes * 8 / link.bandwidth_bps


def all_reduce_time(payload_bytes: float, workers: int, link: Link) -> float:
    """Ring all-reduce: 2(M-1) steps, each moving 1/M of the payload."""
    M = workers
    return exchange_time(2 * (M - 1), 2 * (M - 1) * payload_bytes / M, link) if M > 1 else 0.0


def modelled_time(compute_s: float, exchanges: list, step_s: float, link: Link) -> float:
    """A run's time on `link`: its compute, plus each exchange (hops, bytes sent, overlap steps)
    less what its overlapped inner steps hide."""
    return compute_s + sum(max(0.0, exchange_time(h, b, link) - tau * step_s) for h, b, tau in exchanges)
