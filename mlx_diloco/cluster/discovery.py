"""Finding agents (mDNS browse, or a static host list) and talking to one (`AgentClient`)."""

import socket
import time
from dataclasses import dataclass

from .. import __version__
from ..config import ConfigError
from . import protocol


CONNECT_TRIES = 3


class AgentError(Exception):
    """An agent refused a request, or could not be reached."""


@dataclass
class Found:
    address: str
    port: int
    name: str = ""
    properties: dict = None

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


class _Names:
    """A zeroconf listener that collects the names of the agents' services."""

    def __init__(self):
        self.names = set()

    def add_service(self, zc, type_, name):
        self.names.add(name)

    update_service = add_service

    def remove_service(self, zc, type_, name):
        pass


def _resolve(zc, name: str):
    """The Found of service `name` (its first IPv4 address on the LAN), or None if it does not resolve."""
    from .agent import SERVICE_TYPE
    info = zc.get_service_info(SERVICE_TYPE, name, timeout=3000)
    if info is None or not info.parsed_addresses():
        return None
    props = {k.decode(): (v.decode() if v is not None else "") for k, v in info.properties.items()}
    ipv4 = lan_first([a for a in info.parsed_addresses() if ":" not in a], props.get("interfaces", ""))
    return Found((ipv4 or info.parsed_addresses())[0], info.port, name, props)


def lan_first(addresses: list, interfaces: str) -> list:
    """An agent's addresses with its Thunderbolt ones last: a cable reaches only the Mac at its other
    end, the LAN every machine. `interfaces`: its TXT record's "name=kind/address,..." (agent.advertise)."""
    kinds = {}
    for entry in interfaces.split(","):
        kind, _, address = entry.partition("=")[2].partition("/")
        kinds[address] = kind
    return sorted(addresses, key=lambda a: kinds.get(a) == "thunderbolt")


def browse(timeout_s: float = 3.0) -> list:
    """Agents that answer on mDNS within `timeout_s`."""
    from zeroconf import ServiceBrowser, Zeroconf
    from .agent import SERVICE_TYPE
    zc, listener = Zeroconf(), _Names()
    try:
        ServiceBrowser(zc, SERVICE_TYPE, listener)
        time.sleep(timeout_s)
        return [f for name in sorted(listener.names) if (f := _resolve(zc, name)) is not None]
    finally:
        zc.close()


def watch(on_found, every_s: float = 1.0):
    """Call `on_found` with each agent as it appears on mDNS (and those there now), for as long as the
    process runs: a daemon thread's loop (the launcher's, to admit Macs that come home mid-run)."""
    from zeroconf import ServiceBrowser, Zeroconf
    from .agent import SERVICE_TYPE
    zc, listener, seen = Zeroconf(), _Names(), set()
    ServiceBrowser(zc, SERVICE_TYPE, listener)
    while True:
        for name in sorted(listener.names - seen):
            seen.add(name)
            if (found := _resolve(zc, name)) is not None:
                on_found(found)
        time.sleep(every_s)


def reach(found: list, secret: bytes, wanted: int = None, timeout_s: float = 10.0, log=print) -> tuple:
    """The first `wanted` (default: all) agents of `found` that answer: (their Found, hellos, clients).
    mDNS keeps records of dead agents for minutes, and a listed machine may be off, or another
    cluster's (another secret or version): who does not answer is skipped, in a log line."""
    reachable, agents, clients = [], [], []
    for f in found:
        if wanted is not None and len(reachable) == wanted:
            break
        try:
            client = AgentClient(f, secret, timeout_s=timeout_s)
            agents.append(client.hello())
        except (AgentError, ConfigError) as e:
            log(f"skipping {f.endpoint}: {e}")
            continue
        reachable.append(f)
        clients.append(client)
    return reachable, agents, clients


def parse_hosts(text: str, default_port: int) -> list:
    """'a,b:5000' (or one per line, from a file) -> [Found]."""
    out = []
    for item in text.replace("\n", ",").split(","):
        item = item.split("#")[0].strip()
        if not item:
            continue
        host, _, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        try:
            out.append(Found(host or item, int(port) if port else default_port, item))
        except ValueError:
            raise ConfigError(f"bad host '{item}' in the host list; write HOST or HOST:PORT")
    return out


class AgentClient:
    """One authenticated connection to an agent; `request` sends a message and returns the reply."""

    def __init__(self, found: Found, secret: bytes, timeout_s: float = 10.0):
        self.found, self.secret, self.timeout_s = found, secret, timeout_s
        self.channel = None

    def _connect(self):
        """Connect, and prove the secret with a small signed exchange: the agent takes large frames only
        after it. An agent flooded with connections closes the oldest that have not proven it yet,
        which on a shared address can be ours: a few tries make that rare case harmless."""
        for attempt in range(CONNECT_TRIES):
            try:
                sock = socket.create_connection((self.found.address, self.found.port), timeout=self.timeout_s)
            except OSError as e:
                raise AgentError(f"cannot reach agent at {self.found.endpoint}: {e}")
            try:
                self.channel = protocol.Channel(sock, self.secret, server=False)
                self._exchange({"type": "heartbeat"})
                return
            except ConnectionError as e:  # accepted, then closed before the first answer
                sock.close()
                self.channel = None
                if attempt == CONNECT_TRIES - 1:
                    raise AgentError(f"agent at {self.found.endpoint} closed the connection before answering, "
                                     f"{CONNECT_TRIES} times ({e}): it is full or busy (too many connections at "
                                     "once: other launchers, or a flood from a peer without the secret), or it "
                                     "is restarting; try again later")
                time.sleep(0.1 * 2 ** attempt)
            except (OSError, protocol.ProtocolError) as e:
                sock.close()
                raise AgentError(f"cannot reach agent at {self.found.endpoint}: {e}")

    def request(self, kind: str, **fields) -> dict:
        if self.channel is None:
            self._connect()
        return self._exchange({"type": kind, **fields})

    def _exchange(self, msg: dict) -> dict:
        """Send one request and return its reply; refusals and failures as AgentError or ConfigError."""
        kind = msg["type"]
        try:
            self.channel.send(msg)
            reply = self.channel.recv()
        except protocol.BadSignature:  # its reply is signed with a secret we do not hold
            self.close()
            raise ConfigError(f"agent at {self.found.endpoint} signs with another key: the cluster secret "
                              "differs; set the same MLX_DILOCO_SECRET (or --secret-file) everywhere")
        except (OSError, protocol.ProtocolError) as e:
            if isinstance(e, ConnectionError) and self.channel.received == 0:
                raise  # closed before its first answer: _connect says so, and tries again
            self.close()
            raise AgentError(f"agent at {self.found.endpoint} did not answer '{kind}': {e}")
        if reply.get("type") == "error":
            if reply.get("busy"):
                self.close()
                raise AgentError(f"agent at {self.found.endpoint} refused the connection: {reply['error']}")
            if reply.get("version_mismatch"):
                raise ConfigError(f"agent at {self.found.endpoint}: {reply['error']}")
            raise AgentError(f"agent at {self.found.endpoint} refused '{kind}': {reply['error']}")
        return reply

    def hello(self) -> dict:
        agent = self.request("hello")["agent"]
        if agent["version"] != __version__:
            raise ConfigError(f"agent at {self.found.endpoint} runs mlx-diloco {agent['version']}, this launcher "
                              f"{__version__}: install the same version on every machine")
        return agent

    def close(self):
        if self.channel is not None:
            self.channel.close()
            self.channel = None
