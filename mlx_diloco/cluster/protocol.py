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
mlx-diloco's own worker and link test (see agent.py).

Until its first frame has proven that the peer holds the secret, a connection is held to
FIRST_FRAME bytes and FIRST_FRAME_S seconds (the agent reads first frames without a thread each:
see agent._Server).
"""

import hashlib
import hmac
import os
import socket
import struct

import msgpack

VERSION = 6  # 2: membership changes (save_and_exit, elastic starts); 3: status sends exchanges lines;
#             4: hello reports RDMA devices, start carries the backend (jaccl: devices, coordinator);
#             5: measured links (measure_link; hello reports the links kept);
#             6: start carries the worker's job as one map (worker_job.WorkerJob) and its shard's files
DEFAULT_PORT = 52525
MAX_FRAME = 8 << 20          # bytes; data is sent in chunks well below this
FIRST_FRAME = 4 << 10        # bytes: the limit until a frame has proven the peer holds the secret
FIRST_FRAME_S = 2.0          # seconds a new connection has to send its first (signed) frame to the agent
CHUNK = 4 << 20
NONCE_BYTES = 16
GREETING = b"MLXD"           # the agent's first bytes on a connection, before its nonce
_HEADER = struct.Struct(">I")
_MAC_BYTES = 32
HEAD_BYTES = _HEADER.size + _MAC_BYTES  # length and signature, before the payload
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
    "has_model": {"model": (str,)},
    "put_chunk": {"digest": (str,), "offset": (int,), "size": (int,), "data": (bytes,)},
    "prepare": {"job": (str,)},
    "start": {"job": (str,), "rank": (int,), "hostfile": (list,), "worker": (dict,), "files": (dict,)},
    "status": {"job": (str,), "metrics_from": (int,), "exchanges_from": (int,), "log_from": (int,)},
    "checkpoints": {"job": (str,)},
    "save_and_exit": {"job": (str,), "when": (str,), "after": (int,)},
    "stop": {"job": (str,)},
    "measure_link": {"job": (str,), "rank": (int,), "hostfile": (list,), "sizes": (list,), "link_kind": (str,),
                     "peer": (dict,), "collective_timeout": (float, int)},
}


def given_secret(secret_file: str = None):
    """The cluster secret if one is given (load_secret), else None: for what works without one."""
    return load_secret(secret_file) if secret_file or os.environ.get("MLX_DILOCO_SECRET") else None


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


NO_LOG = 1 << 62  # a status request's log_from (or exchanges_from) past any log: none of it wanted


def file_digest(path) -> str:
    """SHA-256 of a file, hex: the name a blob is sent and stored under."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _mac(secret: bytes, nonce: bytes, direction: bytes, payload: bytes) -> bytes:
    mac = hmac.new(secret, nonce + direction, hashlib.sha256)
    mac.update(payload)  # not concatenated: no copy of a large payload
    return mac.digest()


def _recv_exact(sock, n: int) -> bytearray:
    """n bytes, read into one buffer of that size: no growing and no copies of a large frame."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        part = sock.recv_into(view[got:])
        if not part:
            raise ConnectionError("peer closed the connection")
        got += part
    return buf


def frame_size(head: bytes, limit: int) -> int:
    """The payload size a frame's head announces; ProtocolError past `limit`."""
    (size,) = _HEADER.unpack_from(head)
    if size > limit:
        raise ProtocolError(f"frame of {size} bytes exceeds the {limit}-byte limit" +
                            (" for a connection's first frame" if limit == FIRST_FRAME else ""))
    return size


def bytes_missing(frame: bytes, limit: int) -> int:
    """How many more bytes complete the frame that `frame` begins (0: it is complete)."""
    if len(frame) < HEAD_BYTES:
        return HEAD_BYTES - len(frame)
    return HEAD_BYTES + frame_size(frame, limit) - len(frame)


def return_freed_memory_to_the_system():
    """Make every large allocation its own mapping, unmapped when freed (glibc only).

    glibc otherwise raises its mmap threshold to the largest block freed so far, after which
    8 MB frames come from per-thread heaps that keep the memory for good: ten 8 MB put_chunk
    frames on ten connections at once left an agent at 169 MB instead of 24. Other C libraries
    (macOS) unmap large blocks on free already."""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    M_MMAP_THRESHOLD = -3
    mallopt(M_MMAP_THRESHOLD, 256 << 10)  # a fixed threshold also stops glibc from adjusting it


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
    """One authenticated connection. `server=True` on the agent's side, where `nonce` is the one
    already sent (None: send a fresh one now)."""

    def __init__(self, sock: socket.socket, secret: bytes, server: bool, nonce: bytes = None):
        self.sock, self.secret = sock, secret
        self.send_dir, self.recv_dir = (TO_LAUNCHER, TO_AGENT) if server else (TO_AGENT, TO_LAUNCHER)
        self.sent = self.received = 0
        if server:
            self.nonce = nonce
            if nonce is None:
                self.nonce = os.urandom(NONCE_BYTES)
                sock.sendall(GREETING + self.nonce)
        else:
            head = _recv_exact(sock, len(GREETING) + NONCE_BYTES)
            if head[:len(GREETING)] != GREETING:
                raise ProtocolError("the peer is not an mlx-diloco agent")
            self.nonce = bytes(head[len(GREETING):])

    def send(self, msg: dict):
        self.sent += 1
        payload = msgpack.packb({**msg, "v": VERSION, "seq": self.sent}, use_bin_type=True)
        if len(payload) > MAX_FRAME:
            raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit")
        mac = _mac(self.secret, self.nonce, self.send_dir, payload)
        self.sock.sendall(_HEADER.pack(len(payload)) + mac + payload)

    def recv(self) -> dict:
        """The next frame's payload, authenticated and in order (schema is checked by the caller).
        Until one frame has been authenticated, frames are small (FIRST_FRAME bytes)."""
        head = _recv_exact(self.sock, HEAD_BYTES)
        size = frame_size(head, FIRST_FRAME if self.received == 0 else MAX_FRAME)
        return self.authenticate(bytes(head[_HEADER.size:]), _recv_exact(self.sock, size))

    def authenticate(self, mac: bytes, payload: bytes) -> dict:
        """The payload of a received frame, once its signature (checked first: it is cheap) and
        its place in the sequence are right."""
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

    def authenticate_frame(self, frame: bytes) -> dict:
        """`authenticate` for a whole frame read by the caller (the agent reads first frames itself)."""
        return self.authenticate(bytes(frame[_HEADER.size:HEAD_BYTES]), frame[HEAD_BYTES:])

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
