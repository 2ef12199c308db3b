"""What a machine tells the cluster about itself: chip, memory, network interfaces and their kind
(Thunderbolt, Ethernet, Wi-Fi), and on macOS its Thunderbolt links and RDMA devices.

On macOS the kinds come from `networksetup -listallhardwareports` (port "Thunderbolt 1" is en2...)
and the links from `system_profiler SPThunderboltDataType -json` (each port's domain UUID and the
UUID of the Mac at the other end of the cable). RDMA over Thunderbolt 5 (what MLX's jaccl backend
uses, macOS 26.2+) shows as one verbs device per Thunderbolt port, rdma_en2 for en2, listed with its
port state by `ibv_devinfo` (PORT_ACTIVE once the Macs at both ends of the cable enabled RDMA).
The parsers take the commands' text, so tests run them on captured outputs.
"""

import json
import os
import platform
import re
import socket
import subprocess
import sys

import ifaddr

from .. import __version__


def _run(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# ---------------------------------------------------------------- macOS parsers

def parse_hardware_ports(text: str) -> dict:
    """`networksetup -listallhardwareports` -> {device: port name}, e.g. {"en2": "Thunderbolt 1"}."""
    ports, name = {}, None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and name:
            ports[line.split(":", 1)[1].strip()] = name
            name = None
    return ports


def kind_of_port(port_name: str) -> str:
    if port_name == "Thunderbolt Bridge":
        return "thunderbolt-bridge"
    if port_name.startswith("Thunderbolt"):
        return "thunderbolt"
    if port_name in ("Wi-Fi", "AirPort"):
        return "wifi"
    if "Ethernet" in port_name or port_name.startswith("LAN"):
        return "ethernet"
    return "other"


def parse_thunderbolt(text: str) -> list:
    """`system_profiler SPThunderboltDataType -json` -> one entry per Thunderbolt port:
    {"receptacle": "1", "domain_uuid", "peer_uuid" (None when no Mac is on the cable), "speed"}."""
    try:
        buses = json.loads(text).get("SPThunderboltDataType", [])
    except (json.JSONDecodeError, AttributeError):
        return []
    ports = []
    for bus in buses:
        tag = bus.get("receptacle_1_tag", {})
        peers = [item.get("domain_uuid_key") for item in bus.get("_items", []) if item.get("domain_uuid_key")]
        ports.append({"receptacle": tag.get("receptacle_id_key"), "domain_uuid": bus.get("domain_uuid_key"),
                      "peer_uuid": peers[0] if peers else None, "speed": tag.get("current_speed_key")})
    return ports


def thunderbolt_links(hardware_ports: dict, tb_ports: list) -> list:
    """Cabled Thunderbolt ports with their network interface: [{"interface": "en2", "receptacle": "1",
    "domain_uuid", "peer_uuid", "speed"}]. Port "Thunderbolt N" is receptacle N."""
    device_of = {name.split()[-1]: dev for dev, name in hardware_ports.items()
                 if kind_of_port(name) == "thunderbolt"}
    return [{"interface": device_of.get(p["receptacle"]), **p} for p in tb_ports if p["peer_uuid"]]


def parse_ibv_devinfo(text: str) -> dict:
    """`ibv_devinfo` -> {device: its port's state}, e.g. {"rdma_en2": "PORT_ACTIVE"} (Apple's TN3205
    shows the format; mlx.distributed_config looks for the same rdma_ names in `ibv_devices`)."""
    devices, name = {}, None
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "hca_id":
            name = value.strip()
            devices[name] = "unknown"
        elif key == "state" and name:
            devices[name] = value.split()[0] if value.split() else "unknown"
    return {d: state for d, state in devices.items() if d.startswith("rdma_")}


def macos_version() -> str:
    """"26.2" on macOS, "" elsewhere. From sw_vers: a Python built against an older SDK may be told
    "16.0" for macOS 26 (Apple's compatibility numbering), which would hide jaccl."""
    if sys.platform != "darwin":
        return ""
    return _run(["sw_vers", "-productVersion"]).strip() or platform.mac_ver()[0]


def mlx_version() -> str:
    """The installed MLX's version ("" without MLX), read from its metadata: the agent never imports MLX."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("mlx")
    except PackageNotFoundError:
        return ""


# ---------------------------------------------------------------- this machine

def _linux_kind(name: str) -> str:
    if name == "lo":
        return "loopback"
    if os.path.exists(f"/sys/class/net/{name}/wireless"):
        return "wifi"
    if name.startswith("thunderbolt"):
        return "thunderbolt"
    return "ethernet"


def _hardware_ports() -> dict:
    return parse_hardware_ports(_run(["networksetup", "-listallhardwareports"])) if sys.platform == "darwin" else {}


def interfaces(ports: dict = None) -> list:
    """[{"name", "kind", "address", "prefix"}] for every IPv4 address of this machine; `ports`:
    the hardware ports (macOS), when the caller has them already."""
    ports = _hardware_ports() if ports is None else ports
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if not isinstance(ip.ip, str):
                continue  # IPv6
            name = adapter.nice_name
            kind = ("loopback" if ip.ip.startswith("127.") else kind_of_port(ports[name]) if name in ports
                    else _linux_kind(name) if sys.platform != "darwin" else "other")
            out.append({"name": name, "kind": kind, "address": ip.ip, "prefix": ip.network_prefix})
    return out


def chip() -> str:
    if sys.platform == "darwin":
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def training_memory(cap_bytes: float = None) -> int:
    """What this machine offers a training job: on a Mac what its GPU may wire (by default
    memory.GPU_SHARE of the memory), elsewhere 90%; at most `cap_bytes` (the agent's --max-memory)."""
    from ..machine.memory import GPU_SHARE
    offered = memory_bytes() * (GPU_SHARE if sys.platform == "darwin" else 0.9)
    if sys.platform == "darwin":  # a raised limit (sudo sysctl iogpu.wired_limit_mb=...) counts instead
        raised = _run(["sysctl", "-n", "iogpu.wired_limit_mb"]).strip()
        offered = int(raised) * 2**20 if raised.isdigit() and int(raised) > 0 else offered
    return int(min(offered, cap_bytes) if cap_bytes else offered)


def describe(agent_id: str, memory_cap: float = None) -> dict:
    """Everything the agent reports in its hello and (shortened) in its mDNS record."""
    ports = _hardware_ports()
    tb, rdma = [], {}
    if sys.platform == "darwin":
        tb = thunderbolt_links(ports, parse_thunderbolt(_run(["system_profiler", "SPThunderboltDataType", "-json"])))
        rdma = parse_ibv_devinfo(_run(["ibv_devinfo"]))  # none before macOS 26.2, or until `rdma_ctl enable`
    return {"id": agent_id, "host": socket.gethostname(), "version": __version__, "chip": chip(),
            "memory": memory_bytes(), "training_memory": training_memory(memory_cap), "platform": sys.platform,
            "macos": macos_version(), "mlx": mlx_version(), "interfaces": interfaces(ports), "thunderbolt": tb,
            "rdma": rdma}


def valid_name(text: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text))
