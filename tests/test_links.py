"""Measured links: the bandwidth formulas and the ring they choose (exact, MLX-free), the agent's
kept records, and `mlx-diloco links` on an emulated cluster whose links are shaped with tc."""

import json
import os
import subprocess
import sys

import pytest

from conftest import tiny_config
from mlx_diloco.cluster.agent import Agent, Refused
from mlx_diloco.cluster.emulated import SECRET, EmulatedCluster, can_build
from mlx_diloco.cluster.links import busbw_gbps, parse_size, row, sizes, summarize
from mlx_diloco.cluster.ringplan import plan_ring, ring_hops
from mlx_diloco.config import ConfigError
from test_cluster import config_flags

KB, MB = 1 << 10, 1 << 20


def test_sizes_grow_by_four_from_one_kilobyte():
    assert sizes(4 * MB) == [KB, 4 * KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB]
    assert sizes(5000) == [KB, 4 * KB] and len(sizes()) == 10 and sizes()[-1] == 256 * MB
    assert [parse_size(t) for t in ("256MB", "4M", "1 KB", "65536", "2GiB")] == [256 * MB, 4 * MB, KB, 65536, 2 << 30]
    for bad in ("1.5MB", "lots"):
        with pytest.raises(ConfigError, match="like 256MB"):
            parse_size(bad)
    with pytest.raises(ConfigError, match="at least 1KB"):
        sizes(512)


def test_bus_bandwidth_is_nccl_tests():
    # 1 MiB in 10 ms: algbw 0.8388608 Gbit/s; an all-reduce over n ranks carries 2(n-1)/n of it per link
    assert busbw_gbps("all_reduce", MB, 0.01) == pytest.approx(0.8388608)           # n = 2: factor 1
    assert busbw_gbps("all_reduce", MB, 0.01, ranks=4) == pytest.approx(0.8388608 * 1.5)
    assert busbw_gbps("send_recv", MB, 0.01) == pytest.approx(0.8388608)
    # 4 KB passes in no time (a token bucket's burst): only the two largest sizes count.
    rows = [row("all_reduce", None, KB, 1e-4), row("send_recv", 0, KB, 2e-4), row("send_recv", 1, KB, 4e-4),
            row("all_reduce", None, 4 * KB, 1e-6), row("send_recv", 0, 4 * KB, 1e-6), row("send_recv", 1, 4 * KB, 1e-6),
            row("all_reduce", None, MB, 0.02), row("send_recv", 0, MB, 0.01), row("send_recv", 1, MB, 0.0125),
            row("all_reduce", None, 4 * MB, 0.1), row("send_recv", 0, 4 * MB, 0.1), row("send_recv", 1, 4 * MB, 0.04)]
    link = summarize(rows)
    assert link["gbps"] == pytest.approx(0.4194304)           # the better all-reduce: 1 MB in 20 ms
    assert link["sendrecv_gbps"] == pytest.approx(0.67108864)  # the better slower direction: 1 MB in 12.5 ms
    assert link["latency_ms"] == pytest.approx(0.15)           # half the mean round trip of 1 KB
    assert link["bytes"] == 4 * MB


def host(name, lan, cables=(), kept=None):
    """An agent's hello: a LAN interface, Thunderbolt cables (address on a /30), kept measurements."""
    nets = [{"name": "en0", "kind": "ethernet", "address": lan, "prefix": 24}]
    nets += [{"name": f"en{2 + k}", "kind": "thunderbolt", "address": a, "prefix": 30} for k, a in enumerate(cables)]
    return {"id": name, "host": name, "interfaces": nets, "links": kept or {}}


def keep(agents, a, b, gbps, kind="ethernet", latency_ms=0.1, time=1.0):
    """Agent a's record of its link to b (b keeps none: a's counts for the pair)."""
    agents[a]["links"][agents[b]["id"]] = {"peer": agents[b]["id"], "kind": kind, "gbps": gbps,
                                           "latency_ms": latency_ms, "time": time}


def test_ring_maximises_the_slowest_measured_hop():
    # a-b and c-d are cabled: without measurements the ring puts both cables between neighbours.
    agents = [host("a", "10.0.0.1", ["192.168.1.1"]), host("b", "10.0.0.2", ["192.168.1.2"]),
              host("c", "10.0.0.3", ["192.168.1.5"]), host("d", "10.0.0.4", ["192.168.1.6"])]
    lan = [f"10.0.0.{i}" for i in range(1, 5)]
    assert plan_ring(agents, lan)[0] == [0, 1, 2, 3]
    # Measured, the cables are slow: of the three rings of four (a-b-c-d, a-b-d-c, a-c-b-d) only
    # a-c-b-d avoids both; its slowest hop is a-c.
    rates = {(0, 1): 0.1, (2, 3): 0.1, (0, 2): 0.5, (1, 3): 0.9, (1, 2): 0.95, (0, 3): 0.9}
    for (a, b), gbps in rates.items():
        keep(agents, a, b, gbps, kind="thunderbolt" if (a, b) in ((0, 1), (2, 3)) else "ethernet")
    order, addresses, _ = plan_ring(agents, lan)
    assert order == [0, 2, 1, 3]
    hops = ring_hops(agents, order, addresses)
    assert [h["gbps"] for h in hops] == [0.9, 0.5, 0.95, 0.9] and {h["kind"] for h in hops} == {"ethernet"}
    assert [h["latency_ms"] for h in hops] == [0.1] * 4 and addresses == lan[:1] + [lan[2], lan[1], lan[3]]
    # A record of another kind (taken before the cable was plugged in) does not count: with a-b
    # unmeasured, the cables order the ring.
    keep(agents, 0, 1, 9.0, kind="ethernet")
    assert plan_ring(agents, lan)[0] == [0, 1, 2, 3]
    assert ring_hops(agents, [0, 1, 2, 3], plan_ring(agents, lan)[1])[1] == {"kind": "thunderbolt", "gbps": None,
                                                                            "latency_ms": None}
    # The newest of a pair's two records counts: d's newer one of b-d makes a-c-b-d's slowest hop
    # 0.05, below the cables' 0.1.
    keep(agents, 0, 1, 0.1, kind="thunderbolt")
    keep(agents, 3, 1, 0.05, time=2.0)
    assert plan_ring(agents, lan)[0] == [0, 1, 2, 3]


def test_ties_on_the_slowest_hop_go_to_the_larger_sum():
    agents = [host(n, f"10.0.0.{i}") for i, n in enumerate("abcd", 1)]
    lan = [f"10.0.0.{i}" for i in range(1, 5)]
    # Every ring has a hop at 1 Gbit/s; a-b-c-d sums to 7, a-b-d-c to 9, a-c-b-d to 10.
    for (a, b), gbps in {(0, 1): 1, (0, 2): 1, (1, 2): 2, (2, 3): 2, (0, 3): 2, (1, 3): 5}.items():
        keep(agents, a, b, gbps)
    assert plan_ring(agents, lan)[0] == [0, 2, 1, 3]


def test_agent_keeps_and_reports_measurements(tmp_path):
    agent = Agent(tmp_path, b"x" * 16, name="mini1")
    (tmp_path / "links").mkdir()
    record = {"peer": "f" * 32, "peer_host": "mini2", "kind": "thunderbolt", "gbps": 18.5, "sendrecv_gbps": 19.0,
              "latency_ms": 0.05, "bytes": 256 * MB, "time": 1.0}
    (tmp_path / "links" / f"{'f' * 32}.json").write_text(json.dumps(record))
    (tmp_path / "links" / "torn.json").write_text("{")
    assert agent.describe()["links"] == {"f" * 32: record}
    start = dict(job="links-x", rank=0, hostfile=[["10.0.0.1:5000"], ["10.0.0.2:5000"]], sizes=[KB],
                 link_kind="ethernet", peer={"id": "f" * 32, "host": "mini2"}, collective_timeout=30.0)
    for bad, why in ((dict(rank=2), "ring of two"), (dict(hostfile=[["10.0.0.1:5000"]]), "ring of two"),
                     (dict(link_kind="pigeon"), "link_kind"), (dict(sizes=[3]), "sizes"),
                     (dict(peer={"id": "../x", "host": "m"}), "peer"), (dict(job="../x"), "job names")):
        with pytest.raises(Refused, match=why):
            agent.on_measure_link({**start, **bad})


# ---------------------------------------------------------------- on an emulated cluster (root)

needs_namespaces = pytest.mark.skipif(bool(can_build()), reason=can_build())
FAST, SLOW = 1.0, 0.1  # Gbit/s: the bridge (Ethernet), and the one cable between host1 and host2


def cli(*args, timeout=180):
    result = subprocess.run([sys.executable, "-m", "mlx_diloco", *map(str, args)], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "MLX_DILOCO_SECRET": SECRET})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@needs_namespaces
@pytest.mark.measured
def test_links_measure_the_shaped_rates_and_order_the_ring(tmp_path):
    # Four hosts on a bridge at 1 Gbit/s; host1 and host2 also share a "Thunderbolt" cable at 100 Mbit/s.
    # Counting cables puts host1 and host2 side by side; the measurements keep them apart.
    cluster = EmulatedCluster(4, tmp_path / "cluster", rate="1gbit", cables={(1, 2): "100mbit"}, mdns=False)
    try:
        out = cli("links", f"--hosts={cluster.hosts_flag}", "--max-size=16MB", "--out", tmp_path / "links.json")
        print(out)
        measured = json.loads((tmp_path / "links.json").read_text())
        for pair in measured["pairs"]:
            slow = pair["hosts"] == ["host1", "host2"]
            assert pair["kind"] == ("thunderbolt" if slow else "ethernet")
            rate = SLOW if slow else FAST
            assert pair["sendrecv_gbps"] == pytest.approx(rate, rel=0.1), pair["hosts"]
            assert 0.75 * rate < pair["gbps"] < 1.1 * rate, pair["hosts"]  # MLX's all-reduce: see the bench
            assert pair["latency_ms"] < 5
        ring = measured["ring"]
        assert measured["ordered_by_measurements"] and abs(ring.index("host1") - ring.index("host2")) == 2
        assert f"ring: {' -> '.join(ring + ring[:1])}, slowest hop" in out
        shown = cli("discover", f"--hosts={cluster.hosts_flag}")
        assert "link to host2: thunderbolt" in shown and "link to host4: ethernet" in shown
        plan = cli("plan", "--cluster", f"--hosts={cluster.hosts_flag}", "--params", "10M")
        assert "measured host" in plan and "(ethernet)" in plan and "4 workers" in plan

        # The launcher orders its ring by the agents' kept measurements and writes it to RUN/ring.json.
        run_dir = tmp_path / "run"
        config = tiny_config(workers=4, steps=4, sync_every=2)
        cli("launch", *config_flags(config), f"--hosts={cluster.hosts_flag}", "--run-dir", run_dir, timeout=300)
        hops = json.loads((run_dir / "ring.json").read_text())
        assert [h["host"] for h in hops] == ring and [h["rank"] for h in hops] == [0, 1, 2, 3]
        assert all(h["kind"] == "ethernet" and h["gbps"] > 0.75 * FAST and h["latency_ms"] < 5 for h in hops)
        assert hops[1]["address"] == cluster.address(int(ring[1][-1]))
    finally:
        cluster.close()


@needs_namespaces
def test_launch_measures_links_first(tmp_path):
    cluster = EmulatedCluster(2, tmp_path / "cluster", mdns=False)
    try:
        run_dir = tmp_path / "run"
        config = tiny_config(workers=2, steps=4, sync_every=2)
        cli("launch", *config_flags(config), f"--hosts={cluster.hosts_flag}", "--run-dir", run_dir,
            "--measure-links", timeout=300)
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        (measured,) = [e for e in events if e["event"] == "links_measured"]
        assert [p["hosts"] for p in measured["pairs"]] == [["host1", "host2"]] and measured["pairs"][0]["gbps"] > 0.5
        hops = json.loads((run_dir / "ring.json").read_text())
        assert [h["gbps"] for h in hops] == [pytest.approx(measured["pairs"][0]["gbps"], abs=1e-4)] * 2
    finally:
        cluster.close()


def test_mdns_gives_an_agent_s_lan_address_before_its_cables():
    """An agent advertises every address, its Thunderbolt cables' too; the launcher, on the LAN, can
    reach only the LAN one (the TXT record, agent.advertise's, says which is which)."""
    from mlx_diloco.cluster.discovery import lan_first
    txt = "bridge0=thunderbolt/10.0.12.1,en0=ethernet/192.168.1.5,en1=wifi/192.168.1.6"
    assert lan_first(["10.0.12.1", "192.168.1.5", "192.168.1.6"], txt) == ["192.168.1.5", "192.168.1.6", "10.0.12.1"]
    assert lan_first(["10.0.12.1"], "bridge0=thunderbolt/10.0") == ["10.0.12.1"]  # a record cut at 255 bytes


def test_a_link_is_of_one_kind_seen_from_either_end():
    """A Mac with Ethernet and Wi-Fi on one LAN: the link to it is Ethernet both ways, so the record
    one direction keeps is found from the other (ring_hops looks at both)."""
    from mlx_diloco.cluster.ringplan import link_kind
    both = {"interfaces": [{"kind": "ethernet", "address": "192.168.1.5", "prefix": 24},
                           {"kind": "wifi", "address": "192.168.1.6", "prefix": 24}]}
    wired = {"interfaces": [{"kind": "ethernet", "address": "192.168.1.7", "prefix": 24}]}
    wireless = {"interfaces": [{"kind": "wifi", "address": "192.168.1.8", "prefix": 24}]}
    assert link_kind(both, wired, "192.168.1.7") == link_kind(wired, both, "192.168.1.6") == "ethernet"
    assert link_kind(both, wireless, "192.168.1.8") == link_kind(wireless, both, "192.168.1.5") == "wifi"
    assert link_kind(both, wired, "10.0.0.1") == "other"  # an address the receiver does not have


def test_the_launcher_knows_the_strategy_s_default_sync_period():
    """A worker long in a step is "syncing" at a sync point: H comes from the strategy's default
    when the job did not set it (the config holds only what was given); quorum rounds sync when K
    workers have reported, off that grid."""
    from mlx_diloco.cluster.launcher import sync_grid
    from mlx_diloco.config import TrainConfig
    assert sync_grid(TrainConfig(strategy="diloco").to_dict()) == 50
    assert sync_grid(tiny_config(strategy="diloco").to_dict()) == 4
    assert sync_grid(tiny_config(strategy="ddp").to_dict()) == 0
    assert sync_grid(tiny_config(strategy="quorum").to_dict()) == 0
