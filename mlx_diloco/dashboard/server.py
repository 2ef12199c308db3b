"""The dashboard's server: the page of one run, live or finished, read from its folder (`--dashboard`
on sim, gym run and launch; `mlx-diloco dashboard RUN`).

One JSON endpoint, /api/run, assembles the run folder's files at each request: config.json,
metrics.jsonl, exchanges.jsonl, events.jsonl (the launcher's), summary.json, status.json
(run_status.py) and ring.json (the launcher's ring, each link's kind and measured speed; a sim run's
is its workers over its modelled link), with what the page names from records.py (the time split's
parts, a post-training objective's metrics). The page (static/) asks for it every second until the run
has its summary. A run's files are kilobytes, so each answer holds them whole; a line still being
written is left for the next. Only files inside the run folder are read (a link out of it is not
followed), and a malformed row is passed over, said once in a log line.

Bound to the loopback (the default) the page is this machine's, and a request must name a loopback
host (a web page that rebinds its own name to 127.0.0.1 reads nothing). Bound elsewhere, the page
and its data need a token (?token=..., in the printed URL): derived from the cluster secret for a
cluster's run (every holder of the secret can make it: `token_for`), random otherwise. The page's
code and libraries (/static/) hold no run data and need none.

Served by aiohttp (its low-level server, on an event loop of its own): no thread per connection. A
connection has IDLE_S to send a request and between two (aiohttp >= 3.14.4 also times out one that
never sends any), and an answer without the token closes its connection. Past MAX_CONNECTIONS not
yet served an allowed request, a new one closes the oldest of them: a flood of idle connections from
a peer without the token cannot lock the page out, even under macOS's 256 open files. Connections are
accepted ACCEPT_BATCH a turn, so that a flood never runs the process out of file descriptors; were it
to, asyncio waits a second before it accepts again (no busy loop).
"""

import asyncio
import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import mimetypes
import secrets
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from .. import run_status
from ..exchange.network import parse_link
from ..options import ConfigError
from ..records import HOP, OBJECTIVE, STATUS, TIME_NAMES

STATIC = Path(__file__).parent / "static"
# The page and its code, read once (75 KB): serving them opens no file, even out of file descriptors.
ASSETS = {"/static/" + p.relative_to(STATIC).as_posix(): p.read_bytes() for p in STATIC.rglob("*") if p.is_file()}
PAGE = ASSETS["/static/index.html"]
DEFAULT_PORT = 8470
TOKEN_LABEL = b"mlx-diloco dashboard token"
LOGS = ("metrics", "exchanges", "events")   # NAME.jsonl, a row a line

MAX_ROWS = 20_000                           # of each log, the newest
IDLE_S = 5.0            # a connection's time to send a request, and between two (the page asks every second)
MAX_CONNECTIONS = 64    # open connections not yet served an allowed request (macOS gives a process 256 files)
BACKLOG = 128           # connections the system queues for accept
ACCEPT_BATCH = 32       # connections accepted per turn of the event loop
log = logging.getLogger("mlx_diloco.dashboard")
HTTP_LOG = logging.getLogger("mlx_diloco.dashboard.http")  # aiohttp's own: errors in serving a request


def token_for(secret: bytes) -> str:
    """The token of a dashboard bound beyond the loopback, for a cluster with this secret."""
    return hmac.new(secret, TOKEN_LABEL, hashlib.sha256).hexdigest()[:32]


def parse_where(text: str) -> tuple:
    """--dashboard's value: '' (127.0.0.1, the default port), 'PORT', 'HOST' or 'HOST:PORT' ('[::]:PORT')."""
    text = text.strip()
    if text.isdigit():
        return "127.0.0.1", int(text)
    if text.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # a host, or a bare IPv6 address
        host, port = text, ""
    if port and not port.isdigit():
        raise ConfigError(f"--dashboard {text}: the port must be a number; give PORT, HOST or HOST:PORT")
    return host or "127.0.0.1", int(port) if port else DEFAULT_PORT


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: reachable beyond this machine
        return False


def read_json(path: Path, run_dir: Path):
    """A JSON file's value; None when it is missing, being written, or outside the run folder."""
    if not run_status.within(run_dir, path):
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_rows(path: Path, run_dir: Path) -> list:
    """A JSONL log's rows, the newest MAX_ROWS; a line that is not a JSON object is passed over."""
    if not run_status.within(run_dir, path):
        return []
    try:
        lines = path.read_text(errors="replace").splitlines()[-MAX_ROWS:]
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def modelled_ring(config) -> list:
    """A sim run's ring: its workers, each linked to the next by the link its exchanges are timed on."""
    try:
        link = parse_link(config.get("link") or "1gbe")
        workers = int(config["workers"])
    except (AttributeError, KeyError, TypeError, ValueError, ConfigError):
        return []
    return [HOP.check({HOP.rank: w, HOP.worker: w, HOP.host: "sim", HOP.kind: link.name, HOP.gbps: link.bandwidth_bps / 1e9,
                       HOP.latency_ms: link.latency_s * 1e3, HOP.modelled: True}) for w in range(workers)]


def ranks(status: dict) -> list:
    """A cluster's ring as its status says: the members in rank order, their links unknown."""
    members = sorted((w for w in status.get("workers", []) if w.get(STATUS.rank) is not None),
                     key=lambda w: w[STATUS.rank])
    return [{HOP.rank: w[STATUS.rank], HOP.worker: w.get(STATUS.worker), HOP.host: w.get(STATUS.host), HOP.kind: None,
             HOP.gbps: None, HOP.latency_ms: None} for w in members]


def snapshot(run_dir: Path, say=lambda message: None) -> dict:
    """Everything the page shows of the run in `run_dir`, as it is now (what is passed over: `say`)."""
    run_dir = Path(run_dir)
    config = read_json(run_dir / "config.json", run_dir)
    status = run_status.read(run_dir, say)
    ring = read_json(run_dir / "ring.json", run_dir)
    if not isinstance(ring, list):  # a sim run's modelled ring, or a cluster's before the launcher's ring.json
        cluster = (run_dir / "launch.json").exists() or (status or {}).get("source") == "launch"
        ring = ranks(status or {}) if cluster else modelled_ring(config)
    return {"run": run_dir.resolve().name, "folder": str(run_dir), "time": time.time(), "config": config,
            "summary": read_json(run_dir / "summary.json", run_dir), "status": status, "ring": ring,
            "states": run_status.STATES, "time_parts": list(TIME_NAMES.items()),  # where a worker's time went
            "metric_help": dict(OBJECTIVE),  # what a post-training run's own metrics mean
            **{name: read_rows(run_dir / f"{name}.jsonl", run_dir) for name in LOGS}}


def finite(value):
    """`value` with NaN and infinities as None: JSON has no word for them (a worker out of the job
    has a NaN loss)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


class Dashboard:
    """The page of the run in `run_dir`, served on HOST:PORT by aiohttp from an event loop on a daemon
    thread until `close()` or the process ends. Port 0: any free one; the default port, when taken:
    any free one."""

    def __init__(self, run_dir, host: str = "127.0.0.1", port: int = DEFAULT_PORT, secret: bytes = None):
        self.run_dir, self.host = Path(run_dir), host
        self.token = None if is_loopback(host) else (token_for(secret) if secret else secrets.token_hex(16))
        if not 0 <= port <= 65535:
            raise ConfigError(f"the dashboard's port must be 0 to 65535, not {port} (0: any free one)")
        try:
            sock = _listen(host, port)
        except OSError as e:
            if port != DEFAULT_PORT or e.errno != errno.EADDRINUSE:
                raise ConfigError(f"the dashboard cannot listen on {host}:{port} ({e.strerror}); pass another "
                                  "--dashboard HOST:PORT (port 0: any free one)") from None
            sock = _listen(host, 0)
        self.port = sock.getsockname()[1]
        self.said = set()  # what was logged about the run folder: each thing once
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_LoopErrors())
        self.server = _Server(self._answer, keepalive_timeout=IDLE_S, access_log=None, logger=HTTP_LOG, loop=self.loop)
        self.runner = web.ServerRunner(self.server, shutdown_timeout=1.0)
        self.loop.run_until_complete(self._start(sock))
        self.thread = threading.Thread(target=self.loop.run_forever, name="dashboard", daemon=True)
        self.thread.start()

    async def _start(self, sock: socket.socket):
        await self.runner.setup()
        # asyncio accepts up to `backlog` connections a turn, before any of them is closed: two turns
        # of 128 from a flood ran a process of 256 files out of them. ACCEPT_BATCH a turn, and the
        # system's queue as long as before.
        await web.SockSite(self.runner, sock, backlog=ACCEPT_BATCH).start()
        sock.listen(BACKLOG)

    @property
    def url(self) -> str:
        shown = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        shown = f"[{shown}]" if ":" in shown else shown
        return f"http://{shown}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    def allows(self, host_header: str, token: str) -> bool:
        """A request with the token, or (bound to the loopback) one that names a loopback host."""
        if self.token:
            return hmac.compare_digest(token.encode(), self.token.encode())
        try:
            name = urlsplit(f"//{host_header or ''}").hostname or ""
        except ValueError:  # a malformed Host header (e.g. "[::1"): refused, not a traceback
            return False
        return is_loopback(name)

    async def _answer(self, request: web.BaseRequest) -> web.Response:
        if request.path in ASSETS:
            return _response(200, ASSETS[request.path], mimetypes.guess_type(request.path)[0])
        if not self.allows(request.headers.get("Host"), request.query.get("token", "")):
            refused = _response(403, b"forbidden: open the URL the dashboard printed, with its ?token=\n")
            refused.force_close()  # no second try on this connection: it frees its place at once
            return refused
        self.server.served.add(request.protocol)
        if request.path == "/":
            return _response(200, PAGE, "text/html; charset=utf-8")
        if request.path == "/api/run":
            try:
                run = snapshot(self.run_dir, self._say_once)
            except OSError as e:  # out of file descriptors, say: the page asks again in a second
                return _response(503, f"cannot read the run folder now ({e.strerror})\n".encode())
            return _response(200, json.dumps(finite(run), default=str).encode(), "application/json")
        return _response(404, b"not found\n")

    def _say_once(self, message: str):
        if message not in self.said:
            self.said.add(message)
            log.warning("dashboard of %s: %s", self.run_dir, message)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


def _listen(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                backlog=BACKLOG)


def _response(status: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> web.Response:
    return web.Response(status=status, body=body, headers={
        "Content-Type": kind or "application/octet-stream", "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff"})


class _Server(web.Server):
    """aiohttp's server, holding at most MAX_CONNECTIONS that have not been served an allowed request:
    past that, a new connection closes the oldest of them. A flood opened before the page's own
    connection is pushed out by it; the page's, answered within a round trip, stays."""

    def __init__(self, handler, **kwargs):
        super().__init__(handler, **kwargs)
        self.served = set()  # open connections (aiohttp's RequestHandler) that had an allowed answer

    def connection_made(self, handler, transport):
        super().connection_made(handler, transport)
        # One closed already stays in `connections` until its task is done: passed over, or a burst
        # of connections accepted at once closed only the same oldest one, and the rest held a file
        # each until the process ran out of them (accept then waits a second, for every new one).
        unproven = [c for c in self.connections if c not in self.served and c.transport is not None]
        if len(unproven) > MAX_CONNECTIONS:
            unproven[0].force_close()

    def connection_lost(self, handler, exc=None):
        super().connection_lost(handler, exc)
        self.served.discard(handler)


class _MalformedRequests(logging.Filter):
    """Leaves out aiohttp's traceback for a malformed request: the peer is answered 400, and hostile
    input must not fill the terminal of the run it watches."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))


HTTP_LOG.addFilter(_MalformedRequests())


class _LoopErrors:
    """The event loop's errors (out of file descriptors: asyncio waits a second before it accepts
    again) as one log line a minute, not a traceback a second."""

    def __init__(self):
        self.last = -math.inf

    def __call__(self, loop, context: dict):
        if time.monotonic() - self.last > 60:
            self.last = time.monotonic()
            log.warning("dashboard: %s (%s)", context.get("message"), context.get("exception"))
