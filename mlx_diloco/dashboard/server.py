"""The dashboard's server: the page of one run, live or finished, read from its folder (`--dashboard`
on sim, gym run and launch; `mlx-diloco dashboard RUN`).

One JSON endpoint, /api/run, assembles the run folder's files at each request: config.json,
metrics.jsonl, exchanges.jsonl, events.jsonl (the launcher's), summary.json, status.json
(run_status.py) and ring.json (the launcher's ring, each link's kind and measured speed; a sim run's
is its workers over its modelled link). The page (static/) asks for it every second until the run has its summary. A run's files
are kilobytes, so each answer holds them whole; a line still being written is left for the next.

Bound to the loopback (the default) the page is this machine's, and a request must name a loopback
host (a web page that rebinds its own name to 127.0.0.1 reads nothing). Bound elsewhere, the page
and its data need a token (?token=..., in the printed URL): derived from the cluster secret for a
cluster's run (every holder of the secret can make it: `token_for`), random otherwise. The page's
code and libraries (/static/) hold no run data and need none.
"""

import errno
import hashlib
import hmac
import ipaddress
import json
import math
import mimetypes
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from .. import run_status
from ..exchange.network import parse_link
from ..options import ConfigError

STATIC = Path(__file__).parent / "static"
ASSETS = {"/static/" + p.relative_to(STATIC).as_posix(): p for p in STATIC.rglob("*") if p.is_file()}
DEFAULT_PORT = 8470
TOKEN_LABEL = b"mlx-diloco dashboard token"
LOGS = ("metrics", "exchanges", "events")   # NAME.jsonl, a row a line
MAX_ROWS = 20_000                           # of each log, the newest


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


def read_json(path: Path):
    """A JSON file's value; None when it is missing or being written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_rows(path: Path) -> list:
    """A JSONL log's rows, the newest MAX_ROWS; a line that is not a JSON object is passed over."""
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
    return [{"rank": w, "worker": w, "host": "sim", "kind": link.name, "gbps": link.bandwidth_bps / 1e9,
             "latency_ms": link.latency_s * 1e3, "modelled": True} for w in range(workers)]


def ranks(status: dict) -> list:
    """A cluster's ring as its status says: the members in rank order, their links unknown."""
    members = sorted((w for w in status.get("workers", []) if w.get("rank") is not None), key=lambda w: w["rank"])
    return [{"rank": w["rank"], "worker": w.get("worker"), "host": w.get("host"), "kind": None, "gbps": None,
             "latency_ms": None} for w in members]


def snapshot(run_dir: Path) -> dict:
    """Everything the page shows of the run in `run_dir`, as it is now."""
    run_dir = Path(run_dir)
    config = read_json(run_dir / "config.json")
    status = run_status.read(run_dir)
    ring = read_json(run_dir / "ring.json")
    if not isinstance(ring, list):  # a sim run's modelled ring, or a cluster's before the launcher's ring.json
        cluster = (run_dir / "launch.json").exists() or (status or {}).get("source") == "launch"
        ring = ranks(status or {}) if cluster else modelled_ring(config)
    return {"run": run_dir.resolve().name, "folder": str(run_dir), "time": time.time(), "config": config,
            "summary": read_json(run_dir / "summary.json"), "status": status, "ring": ring, "states": run_status.STATES,
            **{name: read_rows(run_dir / f"{name}.jsonl") for name in LOGS}}


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
    """The page of the run in `run_dir`, served on HOST:PORT from daemon threads until `close()` or
    the process ends. Port 0: any free one; the default port, when taken: any free one."""

    def __init__(self, run_dir, host: str = "127.0.0.1", port: int = DEFAULT_PORT, secret: bytes = None):
        self.run_dir, self.host = Path(run_dir), host
        self.token = None if is_loopback(host) else (token_for(secret) if secret else secrets.token_hex(16))
        if not 0 <= port <= 65535:
            raise ConfigError(f"the dashboard's port must be 0 to 65535, not {port} (0: any free one)")
        try:
            self.httpd = _Server(host, port, self)
        except OSError as e:
            if port != DEFAULT_PORT or e.errno != errno.EADDRINUSE:
                raise ConfigError(f"the dashboard cannot listen on {host}:{port} ({e.strerror}); pass another "
                                  "--dashboard HOST:PORT (port 0: any free one)") from None
            self.httpd = _Server(host, 0, self)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, name="dashboard", daemon=True).start()

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

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, dashboard: Dashboard):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.dashboard = dashboard
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path in ASSETS:
            return self._send(200, ASSETS[url.path].read_bytes(), mimetypes.guess_type(url.path)[0])
        board = self.server.dashboard
        if not board.allows(self.headers.get("Host"), parse_qs(url.query).get("token", [""])[0]):
            return self._send(403, b"forbidden: open the URL the dashboard printed, with its ?token=\n")
        if url.path == "/":
            return self._send(200, (STATIC / "index.html").read_bytes(), "text/html; charset=utf-8")
        if url.path == "/api/run":
            return self._send(200, json.dumps(finite(snapshot(board.run_dir)), default=str).encode(),
                              "application/json")
        self._send(404, b"not found\n")

    def _send(self, code: int, body: bytes, kind: str = "text/plain; charset=utf-8"):
        self.send_response(code)
        self.send_header("Content-Type", kind or "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # a request a second: not for the terminal
        pass
