"""Thunderbolt detection on captured macOS outputs, and the ring plan that uses it."""

from pathlib import Path

from mlx_diloco.cluster.hostinfo import interfaces, kind_of_port, parse_hardware_ports, parse_thunderbolt, thunderbolt_links
from mlx_diloco.cluster.ringplan import plan_ring

DATA = Path(__file__).parent / "data"


def test_hardware_ports_and_kinds():
    ports = parse_hardware_ports((DATA / "networksetup-listallhardwareports.txt").read_text())
    assert ports == {"en0": "Ethernet", "bridge0": "Thunderbolt Bridge", "en1": "Wi-Fi",
                     "en2": "Thunderbolt 1", "en3": "Thunderbolt 2", "en4": "Thunderbolt 3"}
    assert [kind_of_port(ports[d]) for d in ("en0", "bridge0", "en1", "en2")] == \
        ["ethernet", "thunderbolt-bridge", "wifi", "thunderbolt"]


def test_thunderbolt_links_from_system_profiler():
    ports = parse_hardware_ports((DATA / "networksetup-listallhardwareports.txt").read_text())
    tb = parse_thunderbolt((DATA / "system_profiler-thunderbolt.json").read_text())
    assert [p["receptacle"] for p in tb] == ["1", "2", "3"] and tb[2]["peer_uuid"] is None
    links = thunderbolt_links(ports, tb)
    assert [(l["interface"], l["peer_uuid"][:8], l["speed"]) for l in links] == [
        ("en2", "8A1C53E2", "Up to 80 Gb/s"), ("en3", "C3D9E1F0", "Up to 80 Gb/s")]
    assert parse_thunderbolt("not json") == [] and parse_thunderbolt("{}") == []


def test_this_machine_reports_its_interfaces():
    found = interfaces()
    assert any(i["kind"] == "loopback" and i["address"] == "127.0.0.1" for i in found)


def mac(name, lan, *thunderbolt):
    nets = [{"name": "en0", "kind": "ethernet", "address": lan, "prefix": 24}]
    nets += [{"name": f"en{2 + k}", "kind": "thunderbolt", "address": a, "prefix": 30} for k, a in enumerate(thunderbolt)]
    return {"host": name, "interfaces": nets}


def test_ring_follows_the_thunderbolt_cables():
    # A chain of cables a-c, c-b, b-d (a /30 per cable); a and b, c and d are not cabled.
    a = mac("a", "10.0.0.1", "192.168.100.1")
    b = mac("b", "10.0.0.2", "192.168.100.6", "192.168.100.9")
    c = mac("c", "10.0.0.3", "192.168.100.2", "192.168.100.5")
    d = mac("d", "10.0.0.4", "192.168.100.10")
    order, addresses, links = plan_ring([a, b, c, d], ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"])
    assert order == [0, 2, 1, 3]                 # a -> c -> b -> d: three of the four hops are cables
    # rank r listens where rank r-1 reaches it: the cable's far end, or the LAN for d -> a
    assert addresses == ["10.0.0.1", "192.168.100.2", "192.168.100.6", "192.168.100.10"]
    assert links == ["lan", "thunderbolt", "thunderbolt", "thunderbolt"]


def test_ring_without_thunderbolt_keeps_the_order_and_the_lan():
    hosts = [mac(n, f"10.0.0.{i}") for i, n in enumerate("abcd")]
    order, addresses, links = plan_ring(hosts, [f"10.0.0.{i}" for i in range(4)])
    assert order == [0, 1, 2, 3] and links == ["lan"] * 4 and addresses[2] == "10.0.0.2"
