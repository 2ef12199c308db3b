"""The control protocol: authenticated frames, and a live agent that rejects 1,000+ bad frames and
then still runs a valid job, and keeps serving holders of the secret while peers without it flood it."""

import hashlib
import hmac
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from conftest import tiny_config
from mlx_diloco.cluster import protocol
from mlx_diloco.config import ConfigError
from mlx_diloco.cluster.discovery import AgentClient, AgentError, Found, parse_hosts

SECRET = b"fuzz-secret-0123456789abcdef"
V = protocol.VERSION  # the version every well-formed frame carries


def test_channel_round_trip_and_replay_within_a_connection():
    a, b = socket.socketpair()
    server = {}
    t = threading.Thread(target=lambda: server.update(ch=protocol.Channel(a, SECRET, server=True)))
    t.start()
    client = protocol.Channel(b, SECRET, server=False)
    t.join()
    client.send({"type": "heartbeat"})
    assert protocol.validate(server["ch"].recv())["type"] == "heartbeat"
    server["ch"].send({"type": "ok"})
    assert client.recv()["type"] == "ok"
    client.sent = 0  # the next frame reuses seq 1: a replay
    client.send({"type": "heartbeat"})
    with pytest.raises(protocol.ProtocolError, match="out of order or replayed"):
        server["ch"].recv()


def test_schema_and_version_checks():
    with pytest.raises(protocol.VersionMismatch, match="same mlx-diloco version"):
        protocol.validate({"v": 99, "type": "hello"})
    with pytest.raises(protocol.ProtocolError, match="field 'offset' is a str"):
        protocol.validate({"v": V, "type": "put_chunk", "digest": "x", "offset": "0", "size": 1, "data": b""})
    with pytest.raises(protocol.ProtocolError, match="field 'rank' is a bool"):
        protocol.validate({"v": V, "type": "status", "job": "j", "metrics_from": 0} | {"type": "start", "rank": True})


def test_a_peer_of_the_previous_protocol_is_refused_in_one_line():
    """A launcher of protocol 5 sent the worker's job field by field; this agent reads one WorkerJob."""
    old_start = {"v": V - 1, "seq": 1, "type": "start", "job": "j", "rank": 0, "worker_id": 0, "config": {},
                 "hostfile": [["1.2.3.4:5"]], "data": {}, "resume_step": None, "collective_timeout": 30}
    with pytest.raises(protocol.VersionMismatch) as refused:
        protocol.validate(old_start)
    assert str(refused.value) == (f"protocol version {V - 1}, this side speaks {V}: install the same mlx-diloco "
                                  "version on every machine")


def test_missing_secret_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MLX_DILOCO_SECRET", raising=False)
    with pytest.raises(ConfigError, match="MLX_DILOCO_SECRET"):
        protocol.load_secret()


def test_host_list_parsing():
    hosts = parse_hosts("10.0.0.2, mini2.local:6000\n# a comment\n", 52525)
    assert [(h.address, h.port) for h in hosts] == [("10.0.0.2", 52525), ("mini2.local", 6000)]
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_hosts("a:b", 1)


# ---------------------------------------------------------------- a live agent under fire

@pytest.fixture
def agent(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "mlx_diloco", "agent", "--no-mdns", "--bind", "127.0.0.1",
                             "--port", "0", "--state-dir", str(tmp_path / "agent")],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "agent.log", "w"), text=True,
                            env={**os.environ, "MLX_DILOCO_SECRET": SECRET.decode()})
    line = proc.stdout.readline()
    port = int(re.search(r"ready on port (\d+)", line).group(1))
    yield proc, port, tmp_path / "agent.log"
    proc.terminate()
    proc.wait(timeout=10)


def _connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = b""
    while len(head) < 4 + protocol.NONCE_BYTES:
        head += sock.recv(4 + protocol.NONCE_BYTES - len(head))
    return sock, head[4:]


def _frame(msg, secret=SECRET, nonce=b"", direction=protocol.TO_AGENT, raw_payload=None):
    payload = raw_payload if raw_payload is not None else msgpack.packb(msg, use_bin_type=True)
    mac = hmac.new(secret, nonce + direction + payload, hashlib.sha256).digest()
    return struct.pack(">I", len(payload)) + mac + payload


def _outcome(sock) -> str:
    """'ok', 'error: ...' or 'closed'."""
    try:
        head = b""
        while len(head) < 36:
            part = sock.recv(36 - len(head))
            if not part:
                return "closed"
            head += part
        size = struct.unpack(">I", head[:4])[0]
        body = b""
        while len(body) < size:
            body += sock.recv(size - len(body))
        reply = msgpack.unpackb(body)
        return "ok" if reply["type"] == "ok" else f"error: {reply['error']}"
    except (ConnectionError, socket.timeout):
        return "closed"
    finally:
        sock.close()


def _bad_frames(rng: random.Random, port: int):
    """Yield (kind, socket after sending one bad frame)."""
    good = {"v": V, "seq": 1, "type": "status", "job": "j", "metrics_from": 0, "exchanges_from": 0, "log_from": 0}
    wrong_types = [
        {**good, "job": 5}, {**good, "metrics_from": "0"}, {**good, "type": "launch_rockets"},
        {"v": V, "seq": 1, "type": "start", "job": "j", "rank": 0},
        {"v": V, "seq": 1, "type": "put_chunk", "digest": "00", "offset": 0.5, "size": 1, "data": "text"},
        {**good, "v": V + 1}, {**good, "seq": 7}, [1, 2, 3], "just a string",
        {"v": V, "seq": 1, "type": "start", "job": "../../etc", "rank": 0, "hostfile": [], "files": {},
         "worker": {"config": {"model": "tiny"}, "data_worker": 0, "collective_timeout": 1.0}},
        {"v": V, "seq": 1, "type": "start", "job": "j", "rank": 0, "hostfile": [["1.2.3.4:5"]], "files": {},
         "worker": {"config": {"modle": "tiny"}, "data_worker": 0, "collective_timeout": 1.0}},
        {"v": V, "seq": 1, "type": "start", "job": "j", "rank": 0, "hostfile": [["1.2.3.4:5; rm -rf /"]], "files": {},
         "worker": {"config": {"workers": 1}, "data_worker": 0, "collective_timeout": 1.0}},
    ]
    for i in range(1200):
        kind = ["random", "truncated", "oversized", "wrong-secret", "replayed", "wrong-types"][i % 6]
        sock, nonce = _connect(port)
        if kind == "random":
            sock.sendall(os.urandom(rng.randint(1, 300)))
        elif kind == "truncated":
            frame = _frame(good, nonce=nonce)
            sock.sendall(frame[:rng.randint(1, len(frame) - 1)])
            sock.shutdown(socket.SHUT_WR)
        elif kind == "oversized":
            sock.sendall(struct.pack(">I", protocol.MAX_FRAME + rng.randint(1, 1 << 30)) + os.urandom(64))
        elif kind == "wrong-secret":
            sock.sendall(_frame(good, secret=os.urandom(20), nonce=nonce))
        elif kind == "replayed":  # a frame signed for another connection
            other, other_nonce = _connect(port)
            captured = _frame(good, nonce=other_nonce)
            other.sendall(captured)
            assert _outcome(other) == "ok"
            sock.sendall(captured)
        else:
            sock.sendall(_frame(None, nonce=nonce, raw_payload=msgpack.packb(wrong_types[i // 6 % len(wrong_types)])))
        yield kind, sock


def test_agent_rejects_1000_bad_frames_then_runs_a_valid_job(agent, tmp_path):
    proc, port, log = agent
    rng = random.Random(0)
    outcomes = {}
    for kind, sock in _bad_frames(rng, port):
        result = _outcome(sock)
        assert result != "ok", kind
        outcomes.setdefault(kind, []).append(result)
    assert sum(len(v) for v in outcomes.values()) >= 1000
    assert all("bad signature" in r for r in outcomes["wrong-secret"] + outcomes["replayed"])
    assert all("exceeds" in r for r in outcomes["oversized"])
    assert all(r.startswith("error") for r in outcomes["wrong-types"])
    assert proc.poll() is None
    time.sleep(0.5)
    assert log.read_text().count("rejected frame") + log.read_text().count("refused") >= 800

    # ...and then it still runs a valid job, to the end (reading the corpus there: --data-on-workers).
    config = tiny_config(workers=1, steps=4, sync_every=2)
    run_dir = tmp_path / "job"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in config.to_dict().items() if not isinstance(v, bool)]
    result = subprocess.run([sys.executable, "-m", "mlx_diloco", "launch", *flags, f"--hosts=127.0.0.1:{port}",
                             "--data-on-workers", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MLX_DILOCO_SECRET": SECRET.decode()})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "final eval loss" in result.stdout and not (run_dir / "shards").exists()


def test_wrong_secret_and_version_are_clear_errors(agent):
    _, port, _ = agent
    with pytest.raises(ConfigError, match="cluster secret differs"):
        AgentClient(Found("127.0.0.1", port), b"another-secret-0123456789").request("hello")
    sock, nonce = _connect(port)
    sock.sendall(_frame({"v": 99, "seq": 1, "type": "hello"}, nonce=nonce))
    assert "same mlx-diloco version" in _outcome(sock)


def _agent_usage(pid) -> tuple:
    """(resident memory in MB, threads) of a process, from /proc."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(status["VmRSS"].split()[0]) / 1024, int(status["Threads"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_unauthenticated_peers_cannot_hold_memory_or_threads(agent):
    proc, port, _ = agent
    rss0, threads0 = _agent_usage(proc.pid)
    # Ten unsigned 8 MB frames: refused at their header, before any payload is read.
    for _ in range(10):
        sock, _nonce = _connect(port)
        try:
            sock.sendall(struct.pack(">I", protocol.MAX_FRAME - 64) + b"\0" * 32 + os.urandom(protocol.MAX_FRAME - 64))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _outcome(sock) != "ok"
    # 200 idle connections: none gets a thread; each is dropped after FIRST_FRAME_S, or sooner for newer ones.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(200)]
    time.sleep(1)
    rss1, threads1 = _agent_usage(proc.pid)
    assert threads1 <= threads0, (threads0, threads1)
    assert rss1 < rss0 + 40, (rss0, rss1)
    t0 = time.time()
    for sock in idle:  # every one is closed by the agent: pushed out by newer ones, or when its first frame is late
        sock.settimeout(protocol.FIRST_FRAME_S + 10)
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        sock.close()
    assert time.time() - t0 < protocol.FIRST_FRAME_S + 5
    time.sleep(0.5)
    assert _agent_usage(proc.pid)[1] <= threads0 + 1
    assert AgentClient(Found("127.0.0.1", port), SECRET).request("heartbeat")["type"] == "ok"


def test_control_plane_runs_without_mlx(agent):
    """The agent and discover never import MLX: a Mac's agent stays small, and discover starts at once."""
    proc, port, _ = agent
    assert AgentClient(Found("127.0.0.1", port), SECRET).hello()["version"]
    assert "libmlx" not in open(f"/proc/{proc.pid}/maps").read()
    code = ("import sys\nfrom mlx_diloco.cli import main\ntry:\n    main(['discover', '--hosts', '127.0.0.1:%d'])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))" % port)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "MLX_DILOCO_SECRET": SECRET.decode(), "MLX_DILOCO_NO_BLAS_FIX": "1"})
    assert out.stdout.strip().splitlines()[-1] == "[]" and "127.0.0.1" in out.stdout, out.stdout + out.stderr


# ---------------------------------------------------------------- a flood from peers without the secret

def _hello(port) -> str:
    """'ok', or the client's one-line error."""
    try:
        AgentClient(Found("127.0.0.1", port), SECRET).hello()
        return "ok"
    except (AgentError, ConfigError) as e:
        return str(e)


def _flood(port, mode, threads, amount):
    """Start tests/flood_peer.py against the agent; returns once it floods."""
    peer = subprocess.Popen([sys.executable, str(Path(__file__).parent / "flood_peer.py"), str(port), mode,
                             str(threads), str(amount)], stdout=subprocess.PIPE, text=True)
    assert peer.stdout.readline().strip() == "ready"
    return peer


def _hellos_during(peer, port, limit_s, pause_s=0.02) -> list:
    """A launcher's hellos, one every `pause_s` while the flood lasts (at most `limit_s`): their outcomes."""
    outcomes, end = [], time.monotonic() + limit_s
    while peer.poll() is None and time.monotonic() < end:
        outcomes.append(_hello(port))
        time.sleep(pause_s)
    return outcomes


def test_idle_connections_without_the_secret_do_not_lock_out_hello_or_discover(agent):
    _, port, _ = agent
    peer = _flood(port, "hold", 200, 20)  # 200 connections that send nothing, reopened whenever closed
    try:
        assert _hello(port) == "ok"
        out = subprocess.run([sys.executable, "-m", "mlx_diloco", "discover", "--hosts", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "MLX_DILOCO_SECRET": SECRET.decode(), "MLX_DILOCO_NO_BLAS_FIX": "1"})
        assert peer.poll() is None  # the flood lasted until discover was done
    finally:
        peer.kill()
    assert out.returncode == 0 and "mlx-diloco" in out.stdout and "hello failed" not in out.stdout, out.stdout + out.stderr


def test_a_burst_of_connections_without_the_secret_does_not_lock_out_hellos(agent):
    _, port, _ = agent
    peer = _flood(port, "churn", 8, 2000)
    try:
        outcomes = _hellos_during(peer, port, limit_s=30, pause_s=0)
        kept_up = peer.poll() == 0  # the agent took the 2,000 connections within the 30 s
    finally:
        peer.kill()
    print(f"flood: {peer.stdout.read().strip() or 'unfinished after 30 s'}; "
          f"hellos during it: {outcomes.count('ok')} of {len(outcomes)} answered")
    assert kept_up and outcomes and all(o == "ok" for o in outcomes), [o for o in outcomes if o != "ok"][:3]


def test_connections_held_and_reopened_without_the_secret_do_not_lock_out_hellos(agent):
    _, port, _ = agent
    peer = _flood(port, "hold", 64, 3 * protocol.FIRST_FRAME_S)
    try:
        outcomes = _hellos_during(peer, port, limit_s=15)
    finally:
        peer.kill()
    print(f"hellos during the flood: {outcomes.count('ok')} of {len(outcomes)} answered")
    assert len(outcomes) >= 10 and all(o == "ok" for o in outcomes), [o for o in outcomes if o != "ok"][:3]


def test_a_full_agent_says_so(agent):
    """Launchers past MAX_CONNECTIONS are told the agent is busy; a peer that closes before answering
    is named as full or busy, not 'peer closed the connection'."""
    _, port, _ = agent
    from mlx_diloco.cluster.agent import MAX_CONNECTIONS
    from mlx_diloco.cluster.discovery import CONNECT_TRIES
    held = [AgentClient(Found("127.0.0.1", port), SECRET) for _ in range(MAX_CONNECTIONS)]
    for client in held:
        client.request("heartbeat")
    error = _hello(port)
    assert re.fullmatch(r"agent at 127\.0\.0\.1:\d+ refused the connection: it is busy: .*", error), error
    for client in held:
        client.close()
    for greet in (b"", protocol.GREETING + bytes(protocol.NONCE_BYTES)):  # closes before, and after, its greeting
        listener = socket.create_server(("127.0.0.1", 0))

        def close_each_at_once():
            for _ in range(CONNECT_TRIES):
                sock, _ = listener.accept()
                sock.sendall(greet)
                sock.close()
        closer = threading.Thread(target=close_each_at_once)
        closer.start()
        error = _hello(listener.getsockname()[1])
        closer.join()
        listener.close()
        assert re.fullmatch(rf"agent at 127\.0\.0\.1:\d+ closed the connection before answering, {CONNECT_TRIES} "
                            r"times .*: it is full or busy .*", error), error


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_large_frames_leave_no_memory_behind(agent):
    """Ten 8 MB garbage frames at once, signed by peers that proved the secret: the agent's memory comes back."""
    proc, port, _ = agent
    rss0 = _agent_usage(proc.pid)[0]
    clients = [AgentClient(Found("127.0.0.1", port), SECRET) for _ in range(10)]
    for client in clients:
        client.request("heartbeat")
    all_ready, outcomes = threading.Barrier(len(clients)), []

    def send_garbage(channel):
        frame = _frame(None, nonce=channel.nonce, raw_payload=os.urandom(protocol.MAX_FRAME - 64))
        all_ready.wait()
        channel.sock.sendall(frame)
        outcomes.append(_outcome(channel.sock))
    senders = [threading.Thread(target=send_garbage, args=(client.channel,)) for client in clients]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    assert len(outcomes) == 10 and all("undecodable payload" in o for o in outcomes), outcomes
    time.sleep(0.5)
    rss1 = _agent_usage(proc.pid)[0]
    print(f"agent resident memory {rss0:.0f} MB before, {rss1:.0f} MB after")
    assert rss1 < rss0 + 20, (rss0, rss1)
