"""The control protocol between `mlx-diloco launch` and the agents: msgpack frames over TCP.

A frame on the wire is

    4-byte big-endian length | 32-byte HMAC-SHA256 | msgpack payload

The payload is a map {"v": version, "seq": n, "type": name, ...fields}. Every frame is signed
with the shared cluster secret over (connection nonce, direction, payload). The agent opens each
connection by sending a fresh random nonce; from then on both sides number their frames 1, 2, 3...
A frame from another connection (other nonce), a replayed or reordered frame (wrong seq), a
reflected frame (wrong direction), a frame signed with another secret, an oversized frame and a
payload whose fields do not match the message's schema are all rejected. The peer that rejects
says why and closes the connection; nothing in a frame can make an agent run anything but
mlx-diloco's own worker (see agent.py).
"""

import hashlib
import hmac
import os
import socket
import struct
import time

import msgpack

VERSION = 1
DEFAULT_PORT = 52525
MAX_FRAME = 8 << 20          # bytes; data is sent in chunks well below this
FIRST_FRAME = 64 << 10       # bytes: the limit until a frame has proven the peer holds the secret
FIRST_FRAME_S = 10.0         # seconds a new connection has to send its first (signed) frame
CHUNK = 4 << 20
NONCE_BYTES = 16
_HEADER = struct.Struct(">I")
_MAC_BYTES = 32
TO_AGENT, TO_LAUNCHER = b"A", b"L"


class ProtocolError(Exception):
    """A frame that must be rejected (the message says why)."""


class VersionMismatch(ProtocolError):
    pass


class BadSignature(ProtocolError):
    """The frame was signed with another secret (or is a replay from another connection)."""


# What each request carries (field -> allowed types). Replies are {"type": "ok"|"error", ...}.
SCHEMAS = {
    "hello": {},
    "heartbeat": {},
    "has_blob": {"digest": (str,)},
    "put_chunk": {"digest": (str,), "offset": (int,), "size": (int,), "data": (bytes,)},
    "prepare": {"job": (str,)},
    "start": {"job": (str,), "rank": (int,), "worker_id": (int,), "config": (dict,), "hostfile": (list,),
              "data": (dict,), "resume_step": (int, type(None)), "collective_timeout": (float, int)},
    "status": {"job": (str,), "metrics_from": (int,), "log_from": (int,)},
    "checkpoints": {"job": (str,)},
    "stop": {"job": (str,)},
}


def load_secret(secret_file: str = None) -> bytes:
    """The cluster secret from --secret-file, else $MLX_DILOCO_SECRET; a clear error if neither."""
    from ..config import ConfigError
    if secret_file:
        try:
            value = open(secret_file, "rb").read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read secret file {secret_file} ({e.strerror}); "
                              "create it with: mlx-diloco secret > FILE")
    else:
        value = os.environ.get("MLX_DILOCO_SECRET", "").encode()
    if len(value) < 16:
        raise ConfigError("no cluster secret (or one under 16 characters): set MLX_DILOCO_SECRET or pass "
                          "--secret-file, the same on every machine; make one with: mlx-diloco secret")
    return value


NO_LOG = 1 << 62  # a status request's log_from past any log: no output bytes wanted


def file_digest(path) -> str:
    """SHA-256 of a file, hex: the name a blob is sent and stored under."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _mac(secret: bytes, nonce: bytes, direction: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, nonce + direction + payload, hashlib.sha256).digest()


def _recv_exact(sock, n: int, deadline: float = None) -> bytes:
    """n bytes; past `deadline` (time.monotonic) raises TimeoutError, however slowly they trickle in."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the first frame did not arrive in time")
            sock.settimeout(left)
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return bytes(buf)


def validate(msg, schema_of=SCHEMAS) -> dict:
    """Check a decoded request against its schema; return it, or raise ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"payload is a {type(msg).__name__}, not a map")
    if msg.get("v") != VERSION:
        raise VersionMismatch(f"protocol version {msg.get('v')!r}, this side speaks {VERSION}: "
                              "install the same mlx-diloco version on every machine")
    kind = msg.get("type")
    if kind not in schema_of:
        raise ProtocolError(f"unknown message type {kind!r}")
    for name, types in schema_of[kind].items():
        if name not in msg:
            raise ProtocolError(f"'{kind}' lacks field '{name}'")
        value = msg[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolError(f"'{kind}' field '{name}' is a {type(value).__name__}")
    return msg


class Channel:
    """One authenticated connection. `server=True` on the agent's side."""

    def __init__(self, sock: socket.socket, secret: bytes, server: bool):
        self.sock, self.secret = sock, secret
        self.send_dir, self.recv_dir = (TO_LAUNCHER, TO_AGENT) if server else (TO_AGENT, TO_LAUNCHER)
        self.sent = self.received = 0
        if server:
            self.nonce = os.urandom(NONCE_BYTES)
            sock.sendall(b"MLXD" + self.nonce)
        else:
            head = _recv_exact(sock, 4 + NONCE_BYTES)
            if head[:4] != b"MLXD":
                raise ProtocolError("the peer is not an mlx-diloco agent")
            self.nonce = head[4:]

    def send(self, msg: dict):
        self.sent += 1
        payload = msgpack.packb({**msg, "v": VERSION, "seq": self.sent}, use_bin_type=True)
        if len(payload) > MAX_FRAME:
            raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit")
        mac = _mac(self.secret, self.nonce, self.send_dir, payload)
        self.sock.sendall(_HEADER.pack(len(payload)) + mac + payload)

    def recv(self) -> dict:
        """The next frame's payload, authenticated and in order (schema is checked by the caller).
        Until one frame has been authenticated, frames are small and must come quickly: an
        unauthenticated peer can make the other side hold at most FIRST_FRAME bytes for FIRST_FRAME_S."""
        first = self.received == 0
        if first:
            timeout = self.sock.gettimeout()
            try:
                mac, payload = self._read_frame(FIRST_FRAME, time.monotonic() + FIRST_FRAME_S)
            finally:
                self.sock.settimeout(timeout)
        else:
            mac, payload = self._read_frame(MAX_FRAME, None)
        if not hmac.compare_digest(mac, _mac(self.secret, self.nonce, self.recv_dir, payload)):
            raise BadSignature("bad signature: wrong cluster secret, a replay from another connection, "
                               "or a corrupted frame")
        try:
            msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as e:  # signed but undecodable: a buggy peer
            raise ProtocolError(f"undecodable payload ({type(e).__name__})")
        seq = msg.get("seq") if isinstance(msg, dict) else None
        if seq != self.received + 1:
            raise ProtocolError(f"frame out of order or replayed (seq {seq!r}, expected {self.received + 1})")
        self.received += 1
        return msg

    def _read_frame(self, limit: int, deadline):
        (size,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size, deadline))
        if size > limit:
            raise ProtocolError(f"frame of {size} bytes exceeds the {limit}-byte limit" +
                                (" for a connection's first frame" if limit == FIRST_FRAME else ""))
        return _recv_exact(self.sock, _MAC_BYTES, deadline), _recv_exact(self.sock, size, deadline)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
