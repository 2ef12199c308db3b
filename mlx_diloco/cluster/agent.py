"""`mlx-diloco agent`: the long-running service on each machine of a cluster.

It advertises itself over mDNS (`_mlx-diloco._tcp.local.`), answers the control protocol
(protocol.py) and starts, watches and stops this machine's worker process for a job. It keeps
blobs sent by launchers (data shards, by content hash) and each job's worker folder (checkpoints,
logs) under its state folder, so a restarted job resumes from what is on disk.

The only programs an agent ever starts are `python -m mlx_diloco worker --job FILE`, with a job file
(worker_job.py) it has validated itself (TrainConfig, ring addresses, names that cannot leave the
state folder, and what its owner allows a job to read and run: allowed.py), and the link test
`python -m mlx_diloco linktest --job FILE` (cluster/links.py), whose job file it writes itself too.
They run in an empty folder of the agent's (`python -m` puts the working folder on sys.path: what
launchers ship is never importable) with their caches in the state folder. It keeps the last
measurement of each link in STATE/links/ and reports them in its hello.
"""

import collections
import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from .. import run_folder
from ..atomic import atomic_write_text
from ..config import ConfigError
from ..exchange.watchdog import WATCHDOG_EXIT_MARK
from ..worker_job import WorkerJob
from . import hostinfo, protocol
from .allowed import Allowed, shipped_code, shipped_data
from .links import LinkTestJob
from .ringplan import SLOWEST_FIRST
from .hostfile import is_device_matrix

SERVICE_TYPE = "_mlx-diloco._tcp.local."
MAX_CONNECTIONS = 32   # authenticated connections served at once (a launcher holds one per agent)
MAX_WAITING = 128      # connections yet to send a signed first frame; a few file descriptors under macOS's 256
ACCEPT_BATCH = 32      # connections accepted per turn of the loop, between reads of first frames
LISTEN_BACKLOG = 128   # connections the system queues for accept (a flood must not fill it in a moment)
UPLOAD_MAX_AGE_S = 3600  # a partial upload (a blob's chunks so far) not added to for this long is removed
KEEP_FREE = 1 << 30      # bytes of disk that uploads in progress leave free
log = logging.getLogger("mlx_diloco.agent")

_DIGEST = re.compile(r"[0-9a-f]{64}")
_ADDRESS = re.compile(r"[0-9A-Za-z.:\[\]-]{1,64}:[0-9]{1,5}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}(/[A-Za-z0-9_.-]{1,64})?")


class Refused(Exception):
    """A well-formed request the agent will not carry out (the message says why)."""


def _need(ok, message):
    if not ok:
        raise Refused(message)


def read_bytes(path: Path, start: int, limit: int) -> bytes:
    """Up to `limit` bytes of a file from offset `start` (clamped to the file's size)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(min(max(0, start), size))
        return f.read(limit)


def lines_of(path: Path, start: int, limit: int = 1000) -> list:
    """Up to `limit` lines of a JSONL file from line `start` on, the blank ones left out; a last line
    without its newline is still being written: it comes at the next poll."""
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]
    return [line for line in complete[start:][:limit] if line.strip()]


class WorkerProcess:
    """One job's worker on this machine."""

    def __init__(self, popen, folder: Path, run_dir: Path, rank: int, log_start: int):
        self.popen, self.folder, self.run_dir, self.rank = popen, folder, run_dir, rank
        self.log = folder / "worker.log"
        self.log_start = log_start  # worker.log holds every attempt of the job: this one starts here

    def state(self) -> dict:
        code = self.popen.poll()
        tail = ""
        if code is not None:
            tail = read_bytes(self.log, max(self.log_start, self.log.stat().st_size - 3000), 3000)
            tail = tail.decode(errors="replace")
        progress_file = self.folder / "progress.json"
        try:
            progress = json.loads(progress_file.read_text())
            progress["age_s"] = time.time() - progress_file.stat().st_mtime
        except (OSError, ValueError):
            progress = None
        return {"state": "running" if code is None else "exited", "returncode": code, "pid": self.popen.pid,
                "rank": self.rank, "progress": progress, "log_tail": tail,
                "watchdog": WATCHDOG_EXIT_MARK in tail}

    def kill(self):
        if self.popen.poll() is None:
            try:  # the whole process group: SIGKILL also ends a stopped (SIGSTOPped) worker
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait()


class Agent:
    def __init__(self, state_dir: Path, secret: bytes, name: str = None, max_memory: float = None,
                 allowed: Allowed = None):
        self.state_dir = Path(state_dir).expanduser().resolve()  # its workers run elsewhere: a relative path would move
        self.allowed = replace(allowed or Allowed(self.state_dir), state_dir=self.state_dir)
        for folder in ("blobs", "jobs", "workdir", "cache"):  # workdir: the workers' (empty); cache: their token caches
            (self.state_dir / folder).mkdir(parents=True, exist_ok=True)
        id_file = self.state_dir / "agent-id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex)
        self.id = id_file.read_text().strip()
        self.secret, self.name = secret, name
        self.max_memory = max_memory  # bytes offered to training jobs at most (the rest stays for other apps)
        self.jobs = {}
        self.uploads = {}  # digest -> the size a blob being uploaded will have
        self.lock = threading.Lock()

    # ------------------------------------------------------------ requests
    def handle(self, msg: dict) -> dict:
        handler = getattr(self, "on_" + msg["type"])
        return {"type": "ok", **(handler(msg) or {})}

    def on_hello(self, msg):
        return {"agent": self.describe(), "protocol": protocol.VERSION}

    def describe(self) -> dict:
        info = hostinfo.describe(self.id, self.max_memory)
        return {**info, "host": self.name or info["host"], "links": self.kept_links()}

    def kept_links(self) -> dict:
        """{peer agent id: the last measurement of the link to it} (links.kept_record)."""
        kept = {}
        for path in sorted((self.state_dir / "links").glob("*.json")):
            try:
                kept[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                pass  # being rewritten, or torn by a crash: the next measurement replaces it
        return kept

    def on_heartbeat(self, msg):
        return {"time": time.time()}

    def _blob(self, digest: str) -> Path:
        _need(_DIGEST.fullmatch(digest), "digest must be 64 lowercase hex characters (sha256)")
        return self.state_dir / "blobs" / digest

    def on_has_blob(self, msg):
        return {"present": self._blob(msg["digest"]).exists()}

    def on_has_model(self, msg):
        """Whether this machine holds the model folder or cached hub model a job names (hub.py), in a
        folder its jobs may load models from (allowed.py): `refused` says why not, else ''."""
        why = self.allowed.model_problem(msg["model"])
        folder = None if why else self.allowed.model_folder(msg["model"])
        return {"present": folder is not None, "folder": str(folder or ""), "refused": why}

    def on_put_chunk(self, msg):
        """Chunks arrive in order; the last one is checked against the digest before it counts. A blob
        must fit the free disk with every other upload in progress; uploads left unfinished expire."""
        final = self._blob(msg["digest"])
        partial = final.with_name(final.name + ".partial")
        with self.lock:
            self._expire_uploads()
            if final.exists():
                return {"complete": True}
            have = partial.stat().st_size if partial.exists() else 0
            _need(msg["offset"] == have, f"chunk at offset {msg['offset']}, expected {have}")
            _need(0 < msg["size"] < 1 << 40 and have + len(msg["data"]) <= msg["size"], "chunk past the blob's size")
            if have == 0:
                self._need_room(msg["size"])
            self.uploads[msg["digest"]] = msg["size"]
            with open(partial, "ab") as f:
                f.write(msg["data"])
            if have + len(msg["data"]) < msg["size"]:
                return {"complete": False}
            del self.uploads[msg["digest"]]
            if protocol.file_digest(partial) != msg["digest"]:
                partial.unlink()
                raise Refused("checksum mismatch: the blob was corrupted on the way; send it again")
            partial.replace(final)
            return {"complete": True}

    def _need_room(self, size: int):
        """Refuse a new upload that the free disk cannot hold beside the others in progress."""
        blobs = self.state_dir / "blobs"
        coming = sum(total - (blobs / f"{d}.partial").stat().st_size for d, total in self.uploads.items()
                     if (blobs / f"{d}.partial").exists())
        room = shutil.disk_usage(blobs).free - KEEP_FREE - coming
        _need(size <= room, f"a blob of {size / 1e9:.1f} GB does not fit: {max(room, 0) / 1e9:.1f} GB of this "
                            f"machine's disk is free for uploads (with {KEEP_FREE >> 30} GB kept free); free some disk")

    def _expire_uploads(self):
        """Remove the partial uploads no chunk was added to for UPLOAD_MAX_AGE_S (a launcher gone)."""
        for partial in (self.state_dir / "blobs").glob("*.partial"):
            try:
                if time.time() - partial.stat().st_mtime > UPLOAD_MAX_AGE_S:
                    partial.unlink()
                    self.uploads.pop(partial.name.removesuffix(".partial"), None)
                    log.info("removed an upload unfinished for %d s: %s", UPLOAD_MAX_AGE_S, partial.name[:12])
            except FileNotFoundError:
                pass

    def _job_dir(self, job: str) -> Path:
        _need(hostinfo.valid_name(job), "job names are 1-64 letters, digits, '_', '.', '-'")
        return self.state_dir / "jobs" / job

    def on_prepare(self, msg):
        """A free port for this machine's ring endpoint in the job."""
        self._job_dir(msg["job"])
        with socket.socket() as s:
            s.bind(("", 0))
            return {"port": s.getsockname()[1]}

    def on_start(self, msg):
        """Start this machine's worker of a job: the request carries its WorkerJob, which the agent
        completes with where things are here and reads with the worker's own code (WorkerJob.parse).
        With `check_only`, every check of a start and nothing started."""
        folder, given = self._job_dir(msg["job"]), msg["worker"]
        _need(not (placed := sorted(set(given) & set(WorkerJob.HOST_KEYS))),
              f"a launcher may not set {', '.join(placed)}: the agent places the worker's files")
        _need(type(given.get("data_worker")) is int, "worker needs 'data_worker', its worker id (a whole number)")
        run_dir = folder / f"worker-{given['data_worker']}"
        here = {"run_dir": str(run_dir), "own_run_dir": True, "progress": str(folder / "progress.json"),
                "control": str(folder / "control.json") if given.get("ring_slots") else None}
        try:
            job = WorkerJob.parse({**given, **{k: v for k, v in here.items() if v is not None}}, "the worker's job")
        except (ConfigError, TypeError) as e:
            raise Refused(str(e))
        config, hostfile, files = job.train_config, msg["hostfile"], msg["files"]
        _need(not (why := self.allowed.problem(config, shipped=files)), why)  # what it reads and runs
        _need(not shipped_data(config, files) or job.num_shards is not None, "a job that ships data needs num_shards")
        _need(len(hostfile) == job.ring_size and 0 <= msg["rank"] < job.ring_size,
              "the hostfile must have one entry per worker, and rank must index it")
        _need(all(isinstance(e, list) and e and all(isinstance(a, str) and _ADDRESS.fullmatch(a) for a in e)
                  for e in hostfile), "hostfile entries must be lists of 'ip:port'")
        _need(job.backend == "ring" or (is_device_matrix(msg.get("devices"), job.ring_size) and
                                        _ADDRESS.fullmatch(str(msg.get("coordinator")))),
              "jaccl needs 'devices' (MLX's device matrix, one row per worker) and 'coordinator' ('ip:port')")
        if msg.get("check_only"):  # a launcher asks every agent first, before it ships or starts anything
            return {}
        with self.lock:
            old = self.jobs.get(msg["job"])
            _need(old is None or old.popen.poll() is not None, f"job {msg['job']} is already running here; stop it first")
            folder.mkdir(parents=True, exist_ok=True)
            if job.resume_step is None and run_dir.exists():  # a fresh start: old checkpoints must not count
                shutil.rmtree(run_dir)
            if files:  # its data shard, and the files of code it names by their shipped names
                placed = self._materialize_data(folder, job.data_worker, files)
                code = {key: str(Path(placed) / name) for key, name in shipped_code(config, files).items()}
                job = replace(job, config={**job.config, **code},
                              data_dir=placed if shipped_data(config, files) else None)
            if self.max_memory and not 0 < config.memory_limit * 1e9 <= self.max_memory:
                # The memory this machine offers is a limit its worker keeps to, not only a number
                # the launcher checks: MLX waits for queued work before allocating past it.
                job = replace(job, config={**job.config, "memory_limit": round(self.max_memory / 1e9, 3)})
            (folder / "control.json").unlink(missing_ok=True)  # an old request must not stop the new worker
            job.write(folder / "job.json")
            (folder / "hostfile.json").write_text(json.dumps(hostfile))
            (folder / "progress.json").unlink(missing_ok=True)
            env = {**os.environ, "MLX_RANK": str(msg["rank"]), "MLX_HOSTFILE": str(folder / "hostfile.json")}
            if job.backend == "jaccl":  # what mlx.launch sets for jaccl (mlx/_distributed_utils/launch.py)
                (folder / "devices.json").write_text(json.dumps(msg["devices"]))
                env.update(MLX_IBV_DEVICES=str(folder / "devices.json"), MLX_JACCL_COORDINATOR=msg["coordinator"])
            popen = self._spawn(msg["job"], folder, run_dir, msg["rank"], ["worker", "--job", str(folder / "job.json")], env)
            log.info("job %s: started worker %d as rank %d (pid %d)", msg["job"], job.data_worker, msg["rank"], popen.pid)
        return {"pid": popen.pid}

    def _spawn(self, job: str, folder: Path, run_dir: Path, rank: int, command: list, env: dict):
        """Start `python -m mlx_diloco COMMAND` for a job, its output appended to its folder's worker.log.
        It runs in STATE/workdir, which stays empty: `-m` puts the working folder first on sys.path, and
        the job's folder holds what launchers send (a data file named evil.py must never be imported)."""
        env = {**env, "MLX_DILOCO_CACHE": str(self.state_dir / "cache")}
        with open(folder / "worker.log", "ab") as out:
            log_start = out.seek(0, os.SEEK_END)
            popen = subprocess.Popen([sys.executable, "-m", "mlx_diloco", *command], cwd=self.state_dir / "workdir",
                                     stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.jobs[job] = WorkerProcess(popen, folder, run_dir, rank, log_start)
        return popen

    def _materialize_data(self, folder: Path, worker_id: int, files: dict) -> str:
        """Link the shipped blobs into the worker's data folder: its WorkerJob's data_dir."""
        target = folder / f"data-{worker_id}"
        for name, digest in files.items():
            _need(isinstance(name, str) and _FILE_NAME.fullmatch(name) and ".." not in name, f"bad file name {name!r}")
            _need(isinstance(digest, str), f"bad digest for {name!r}")
            blob = self._blob(digest)
            _need(blob.exists(), f"blob {digest[:12]} for {name} was not sent")
            dest = target / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.unlink(missing_ok=True)
            os.link(blob, dest)
        return str(target)

    def on_status(self, msg):
        self._job_dir(msg["job"])
        worker = self.jobs.get(msg["job"])
        if worker is None:
            return {"state": "unknown"}
        out = worker.state()
        log_piece = read_bytes(worker.log, msg["log_from"], 64 << 10)  # the worker's output, streamed in pieces
        return {**out, "metrics": lines_of(worker.run_dir / "metrics.jsonl", msg["metrics_from"]),
                "exchanges": lines_of(worker.run_dir / "exchanges.jsonl", msg["exchanges_from"]), "log": log_piece}

    def on_checkpoints(self, msg):
        """Steps of the complete checkpoints of this machine's workers in the job: {worker_id: [steps]}."""
        return {"steps": {wdir.name.split("-", 1)[1]: run_folder.steps(wdir)
                          for wdir in self._job_dir(msg["job"]).glob("worker-*")}}

    def on_save_and_exit(self, msg):
        """Ask this machine's worker to save its state and exit (elastic.StopRequests): `now`, at the end of
        its step, or `at_sync` from step `after` on. A worker that waits on a lost peer does not read it:
        it saved its state before that exchange, and the launcher stops it."""
        folder = self._job_dir(msg["job"])
        _need(msg["when"] in ("now", "at_sync") and isinstance(msg.get("after", 0), int), "when: now or at_sync")
        request = {"stop": msg["when"], "after": msg.get("after", 0)}
        if folder.is_dir():
            atomic_write_text(folder / "control.json", json.dumps(request))
        return {}

    def on_stop(self, msg):
        self._job_dir(msg["job"])
        worker = self.jobs.get(msg["job"])
        if worker is not None:
            worker.kill()
            log.info("job %s: worker stopped", msg["job"])
        return {}

    def on_measure_link(self, msg):
        """Start this machine's side of a link test: a two-process MLX ring with the peer's agent, which
        times all-reduces and sends of growing sizes (`mlx-diloco links`). Its rows come with `status`."""
        folder, peer, sizes = self._job_dir(msg["job"]), msg["peer"], msg["sizes"]
        _need(msg["rank"] in (0, 1) and len(msg["hostfile"]) == 2, "a link test is a ring of two: rank 0 or 1")
        _need(all(isinstance(e, list) and len(e) == 1 and isinstance(e[0], str) and _ADDRESS.fullmatch(e[0])
                  for e in msg["hostfile"]), "hostfile entries must be lists of one 'ip:port'")
        _need(isinstance(peer.get("id"), str) and hostinfo.valid_name(peer["id"]) and isinstance(peer.get("host"), str)
              and len(peer["host"]) <= 64, "peer must be {'id': its agent id, 'host': its name}")
        _need(msg["link_kind"] in SLOWEST_FIRST, f"link_kind must be one of {', '.join(SLOWEST_FIRST)}")
        _need(0 < len(sizes) <= 16 and all(isinstance(n, int) and 4 <= n <= 1 << 32 and n % 4 == 0 for n in sizes),
              "sizes must be 1-16 byte counts, multiples of 4, up to 4 GB")
        _need(0 < msg["collective_timeout"] <= 86400, "timeout out of range")
        with self.lock:
            old = self.jobs.get(msg["job"])
            _need(old is None or old.popen.poll() is not None, f"link test {msg['job']} is already running here")
            folder.mkdir(parents=True, exist_ok=True)
            rows = folder / "metrics.jsonl"
            rows.unlink(missing_ok=True)  # status returns this test's rows only
            LinkTestJob(sizes, float(msg["collective_timeout"]), rows=str(rows),
                        keep=str(self.state_dir / "links" / f"{peer['id']}.json"),
                        peer={"id": peer["id"], "host": peer["host"]}, kind=msg["link_kind"]).write(folder / "linktest.json")
            (folder / "hostfile.json").write_text(json.dumps(msg["hostfile"]))
            env = {**os.environ, "MLX_RANK": str(msg["rank"]), "MLX_HOSTFILE": str(folder / "hostfile.json")}
            popen = self._spawn(msg["job"], folder, folder, msg["rank"], ["linktest", "--job", str(folder / "linktest.json")],
                                env)
            log.info("link test %s: started rank %d to %s (pid %d)", msg["job"], msg["rank"], peer["host"], popen.pid)
        return {"pid": popen.pid}

    def stop_all(self):
        for worker in self.jobs.values():
            worker.kill()

    def reap(self):
        """Collect the exit of each worker that ended on its own: until then it stays a zombie
        process (until a launcher asks about its job, which may be never)."""
        for worker in list(self.jobs.values()):
            worker.popen.poll()


class _Waiting:
    """A connection that has not yet sent its first frame, so has not proven it holds the secret."""

    def __init__(self, sock: socket.socket, address: str):
        self.sock, self.address = sock, address
        self.nonce = os.urandom(protocol.NONCE_BYTES)
        self.deadline = time.monotonic() + protocol.FIRST_FRAME_S
        self.frame = bytearray()


class _Server:
    """Accepts connections, and serves those that prove they hold the cluster secret.

    A peer without the secret must not lock out one with it, so one thread (serve_forever) reads
    every connection's first frame, and only a connection whose first frame is signed with the
    secret gets a thread and one of MAX_CONNECTIONS places. Until then a connection may send at
    most protocol.FIRST_FRAME bytes within protocol.FIRST_FRAME_S, and at most MAX_WAITING
    connections wait: past that, the oldest waiting connection of the address with the most
    waiting ones is closed. Refusing the newest instead would let anyone who keeps MAX_WAITING
    connections open refuse everyone else. Closing the oldest closes what a flood opened before,
    while a launcher sends its first frame a round trip after it connects, and that frame is read
    before more connections are accepted (a launcher closed all the same tries again: see
    discovery.AgentClient)."""

    def __init__(self, address: tuple, agent: Agent):
        self.agent = agent
        self.listener = socket.create_server(address, backlog=LISTEN_BACKLOG)
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.waiting = {}  # socket -> _Waiting, oldest first
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.stopping = threading.Event()
        self.dropped, self.reported = collections.Counter(), time.monotonic()
        self.reaped = time.monotonic()  # when exited workers were last collected (Agent.reap)

    def serve_forever(self, poll_interval: float = 0.2):
        while not self.stopping.is_set():
            events = self.selector.select(poll_interval)
            for key, _ in events:
                if key.data is not None:
                    self._read(key.data)
            if any(key.fileobj is self.listener for key, _ in events):
                self._accept()  # after the reads: a frame that has arrived is read before more connections come in
            self._drop_late()
            self._report_dropped()
            if time.monotonic() - self.reaped > 1:
                self.agent.reap()
                self.reaped = time.monotonic()

    def shutdown(self):
        self.stopping.set()

    def server_close(self):
        for waiting in list(self.waiting.values()):
            self._close(waiting)
        self.selector.close()
        self.listener.close()

    # ------------------------------------------------------------ connections without a signed frame yet
    def _accept(self):
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of file descriptors: make room for the next turn
                log.warning("cannot accept a connection: %s", e)
                if self.waiting:
                    self._evict()
                time.sleep(0.05)
                return
            if len(self.waiting) >= MAX_WAITING:
                self._evict()
            self._admit(sock, address[0])

    def _admit(self, sock: socket.socket, address: str):
        waiting = _Waiting(sock, address)
        try:
            sock.setblocking(False)
            sock.send(protocol.GREETING + waiting.nonce)  # 20 bytes into an empty send buffer
        except OSError:
            sock.close()
            return
        self.waiting[sock] = waiting
        self.selector.register(sock, selectors.EVENT_READ, waiting)

    def _evict(self):
        """Close the oldest waiting connection of the address that has the most waiting."""
        crowded = collections.Counter(w.address for w in self.waiting.values()).most_common(1)[0][0]
        self._close(next(w for w in self.waiting.values() if w.address == crowded), "pushed out by newer ones")

    def _drop_late(self):
        now = time.monotonic()
        for waiting in list(self.waiting.values()):  # oldest first
            if waiting.deadline > now:
                return
            self._close(waiting, f"no first frame within {protocol.FIRST_FRAME_S:g} s")

    def _read(self, waiting: _Waiting):
        """Read what has come of a first frame; once it is whole, serve its connection in a thread
        if it is signed with the secret."""
        try:
            part = waiting.sock.recv(protocol.bytes_missing(waiting.frame, protocol.FIRST_FRAME))
        except BlockingIOError:
            return
        except OSError:
            part = b""
        if not part:
            return self._close(waiting)
        waiting.frame += part
        channel = protocol.Channel(waiting.sock, self.agent.secret, server=True, nonce=waiting.nonce)
        try:
            if protocol.bytes_missing(waiting.frame, protocol.FIRST_FRAME) > 0:
                return
            request = channel.authenticate_frame(waiting.frame)
        except protocol.ProtocolError as e:  # too large for a first frame, or not signed with the secret
            self._forget(waiting)
            self._reject(channel, waiting.address, e)
            return channel.close()
        self._forget(waiting)
        if not self.slots.acquire(blocking=False):
            log.warning("refused a connection from %s: %d connections open", waiting.address, MAX_CONNECTIONS)
            _reply(channel, {"type": "error", "busy": True,
                             "error": f"it is busy: {MAX_CONNECTIONS} connections open (a launcher holds one); "
                                      "stop a launcher or try again later"})
            return channel.close()
        waiting.sock.settimeout(600)
        threading.Thread(target=self._serve, args=(channel, request, waiting.address), daemon=True).start()

    def _forget(self, waiting: _Waiting):
        del self.waiting[waiting.sock]
        self.selector.unregister(waiting.sock)

    def _close(self, waiting: _Waiting, why: str = None):
        self._forget(waiting)
        waiting.sock.close()
        if why:
            self.dropped[(waiting.address, why)] += 1

    def _report_dropped(self):
        """One log line per address and reason every 10 s, not one per connection of a flood."""
        if self.dropped and time.monotonic() - self.reported > 10:
            for (address, why), count in self.dropped.items():
                log.warning("closed %d connections from %s that had not proven the secret: %s", count, address, why)
            self.dropped.clear()
            self.reported = time.monotonic()

    # ------------------------------------------------------------ authenticated connections
    def _serve(self, channel: protocol.Channel, msg: dict, peer: str):
        """Serve one connection (its first request is `msg`) until it closes or sends a frame that
        must be rejected."""
        try:
            while True:
                try:
                    request = protocol.validate(msg)
                except protocol.ProtocolError as e:
                    return self._reject(channel, peer, e)
                if not _reply(channel, _answer(self.agent, request, peer)):
                    return
                msg = request = None  # a large frame is freed before the next one is waited for
                try:
                    msg = channel.recv()
                except (ConnectionError, socket.timeout, OSError):
                    return
                except protocol.ProtocolError as e:
                    return self._reject(channel, peer, e)
        finally:
            channel.close()
            self.slots.release()

    @staticmethod
    def _reject(channel: protocol.Channel, peer: str, error: protocol.ProtocolError):
        """Say why a frame is rejected; the caller drops the connection (the stream may be out of step)."""
        log.warning("rejected frame from %s: %s", peer, error)
        _reply(channel, {"type": "error", "error": str(error),
                         "version_mismatch": isinstance(error, protocol.VersionMismatch)})


def _answer(agent: Agent, msg: dict, peer: str) -> dict:
    try:
        return agent.handle(msg)
    except Refused as e:
        log.warning("refused %s from %s: %s", msg["type"], peer, e)
        return {"type": "error", "error": str(e)}
    except Exception as e:  # a bug must not take the agent down
        log.exception("error handling %s", msg["type"])
        return {"type": "error", "error": f"{type(e).__name__}: {e}"}


def _reply(channel: protocol.Channel, reply: dict) -> bool:
    try:
        channel.send(reply)
        return True
    except (OSError, protocol.ProtocolError):
        return False


def advertise(agent: Agent, port: int, addresses: list):
    """Register the agent over mDNS; returns the Zeroconf instance (close it to unregister)."""
    from zeroconf import ServiceInfo, Zeroconf
    info = agent.describe()
    # A TXT value holds at most 255 bytes: the full list comes with the hello.
    nets = ",".join(f"{i['name']}={i['kind']}/{i['address']}" for i in info["interfaces"] if i["kind"] != "loopback")
    service = ServiceInfo(
        SERVICE_TYPE, f"{info['host']}-{agent.id[:8]}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton(a) for a in addresses], port=port,
        properties={"id": agent.id, "host": info["host"], "version": info["version"],
                    "protocol": str(protocol.VERSION), "chip": info["chip"][:80],
                    "memory": str(info["memory"]), "interfaces": nets[:255]},
        server=f"{info['host']}-{agent.id[:8]}.local.")
    zc = Zeroconf()
    zc.register_service(service)
    return zc


def serve(state_dir: Path, secret: bytes, port: int = protocol.DEFAULT_PORT, bind: str = "", mdns: bool = True,
          name: str = None, max_memory: float = None, allowed: Allowed = None):
    """Run the agent until SIGINT/SIGTERM."""
    agent = Agent(state_dir, secret, name, max_memory, allowed)
    protocol.return_freed_memory_to_the_system()
    server = _Server((bind, port), agent)
    port = server.server_address[1]
    addresses = [i["address"] for i in hostinfo.interfaces() if i["kind"] != "loopback"] or ["127.0.0.1"]
    if bind and bind != "0.0.0.0":
        addresses = [bind]
    zc = advertise(agent, port, addresses) if mdns else None
    log.info("agent %s listening on %s:%d (%s)", agent.id[:8], bind or "*", port, ", ".join(addresses))
    print(f"agent {agent.id[:8]} ready on port {port}", flush=True)

    def shut_down(*_):
        threading.Thread(target=server.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, shut_down)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        agent.stop_all()
        if zc:
            zc.unregister_all_services()
            zc.close()
        server.server_close()
