"""`mlx-diloco launch`: run a job on the agents of a real cluster, and keep it running.

1. Connect to the chosen agents (found over mDNS or listed), check versions.
2. Ship each worker its data shard (content-addressed: a restart resends nothing).
3. Order the ring (Thunderbolt between neighbours where cabled), write the hostfile, start the
   workers through their agents.
4. Watch: every agent is polled twice a second (the heartbeat). Rank 0's metrics are mirrored
   into this run folder's metrics.jsonl, so `mlx-diloco plot` compares cluster and sim runs.
5. On a failure (a worker exits, stalls, or its agent stops answering) stop the round and restart
   every worker from the newest outer-step checkpoint they all hold: with the machines that remain
   (`--on-loss shrink`) or once the lost one answers again (`--on-loss wait`).

Everything the launcher knows is in RUN/launch.json, so `launch --resume --run-dir RUN` after a
launcher crash re-attaches to the running workers, or restarts them from their checkpoints.
"""

import json
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from .. import hub
from ..atomic import atomic_write_text
from ..config import ConfigError, TrainConfig
from ..training.metrics import MetricsLog, human_bytes
from . import protocol
from .discovery import AgentClient, AgentError, Found
from .ringplan import plan_ring


@dataclass
class Member:
    """One machine of the job and the data shard its worker trains."""
    address: str
    port: int
    worker_id: int
    host: str = ""

    @property
    def found(self) -> Found:
        return Found(self.address, self.port)


@dataclass
class Options:
    on_loss: str = "shrink"             # or "wait"
    collective_timeout: float = 30.0    # s a collective may wait before a worker gives up
    heartbeat_timeout: float = 5.0      # s an agent may stay silent before its machine counts as lost
    startup_timeout: float = 300.0      # s a worker may take to report its first step
    max_restarts: int = 5
    data_on_workers: bool = False       # the config's data path exists on every machine


@dataclass
class JobState:
    """What launch.json holds."""
    job: str
    config: dict
    members: list
    num_shards: int
    options: dict
    data_files: dict = field(default_factory=dict)   # worker_id -> {file name: sha256}
    restarts: int = 0
    finished: bool = False

    def save(self, run_dir: Path):
        atomic_write_text(run_dir / "launch.json", json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: Path) -> "JobState":
        path = run_dir / "launch.json"
        if not path.exists():
            raise ConfigError(f"no launch.json in {run_dir}: nothing to resume; drop --resume to start a job")
        state = cls(**json.loads(path.read_text()))
        state.members = [Member(**m) for m in state.members]
        return state


class JobFailed(Exception):
    pass


def cut_shards(config: TrainConfig, num_shards: int, folder: Path, log=print) -> dict:
    """Tokenize the corpus here once and cut one shard per worker into folder/worker-K, without
    building the model. Returns {worker: {file name: sha256}}, what the agents are sent."""
    from ..data.datasets import write_shard
    from ..models.zoo import load_spec
    from ..training.resolve import load_data
    data = load_data(config, load_spec(config.model), log=log)
    files = {}
    for w in range(num_shards):
        shard = write_shard(data, w, num_shards, folder / f"worker-{w}")
        files[str(w)] = {str(p.relative_to(shard)): protocol.file_digest(p)
                         for p in sorted(shard.rglob("*")) if p.is_file()}
    return files


def check_memory(config: TrainConfig, strategy, agents: list):
    """Refuse, before anything starts, a job whose worker will not fit on one of the machines:
    name the machine, the estimate, and the smallest change that makes it fit."""
    from ..memory import estimate, flags, make_it_fit, worker_estimate
    o, shape, need = worker_estimate(config, strategy)
    for a in agents:
        offered = a.get("training_memory") or 0.9 * a.get("memory", 0)
        if need["total"] <= offered:
            continue
        fix = make_it_fit(shape, o, offered)
        hint = (f"pass {flags(o, fix)} (about {human_bytes(estimate(shape, fix)['total'])})" if fix
                else "choose a smaller model preset")
        raise ConfigError(f"{a['host']} offers {human_bytes(offered)} for training but one worker of this job needs "
                          f"about {human_bytes(need['total'])} (model {config.model}, {o.describe()}); {hint}, "
                          "or leave that machine out")


def check_model_here(model: str):
    """The launcher reads the model too (to tokenize the data and estimate memory): refuse, in one
    line, when this machine lacks it, rather than download it here."""
    if hub.names_files(model) and hub.local_folder(model) is None:
        raise ConfigError(f"this machine (the launcher) lacks model {model}, which it reads to tokenize the data "
                          f"and estimate memory; {hub.how_to_get(model)} here too")


def has_model(client: AgentClient, model: str) -> bool:
    try:
        return client.request("has_model", model=model)["present"]
    except AgentError:  # it stopped answering since its hello: it cannot run the job either
        return False


def check_model(model: str, agents: list, clients: list):
    """Refuse, before anything starts, a job whose model folder (or cached hub model) some of the
    machines lack: each Mac loads it from its own disk. Name every one of them, and the fix."""
    if not hub.names_files(model):
        return
    lacking = [a["host"] for a, c in zip(agents, clients) if not has_model(c, model)]
    if lacking:
        raise ConfigError(f"model {model} is missing on {', '.join(lacking)} (each Mac loads it from its own disk); "
                          f"{hub.how_to_get(model)} on each of them, or leave them out")


class Launcher:
    def __init__(self, state: JobState, run_dir: Path, secret: bytes, log=print):
        self.state, self.run_dir, self.secret, self.log = state, Path(run_dir), secret, log
        self.options = Options(**state.options)
        self.clients = {}
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.events = self.run_dir / "events.jsonl"
        (self.run_dir / "logs").mkdir(exist_ok=True)  # each worker's output, copied as it comes

    # ------------------------------------------------------------ setup
    @classmethod
    def new(cls, config: TrainConfig, found: list, run_dir: Path, secret: bytes, options: Options, log=print):
        from ..training.resolve import resolve
        check_model_here(config.model)
        run_dir, resolved = Path(run_dir), resolve(config)
        config = resolved.config
        if (run_dir / "launch.json").exists():
            raise ConfigError(f"{run_dir} already holds a job; pass --resume to continue it, or another --run-dir")
        reachable, agents, clients = [], [], []
        for f in found:  # mDNS keeps records of dead agents for minutes: skip who does not answer
            if len(reachable) == config.workers:
                break
            try:
                client = AgentClient(f, secret)
                agents.append(client.hello())
                reachable.append(f)
                clients.append(client)
            except (AgentError, ConfigError) as e:  # dead, or another cluster's agent (other secret)
                log(f"[launch] skipping {f.endpoint}: {e}")
        if len(reachable) < config.workers:
            raise ConfigError(f"{config.workers} workers wanted but {len(reachable)} agents answered; start more "
                              "agents (mlx-diloco agent), pass --hosts, or lower --workers")
        check_model(config.model, agents, clients)
        check_memory(config, resolved.strategy, agents)
        members = [Member(f.address, f.port, worker_id=w, host=a["host"])
                   for w, (f, a) in enumerate(zip(reachable, agents))]  # start() orders the ring
        job = f"{run_dir.name[:40]}-{secrets.token_hex(3)}".replace(" ", "_")
        state = JobState(job, config.to_dict(), members, config.workers, asdict(options))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        launcher = cls(state, run_dir, secret, log)
        if not options.data_on_workers:
            launcher.write_shards(config)
        state.save(run_dir)
        return launcher

    def client(self, m: Member) -> AgentClient:
        key = (m.address, m.port)
        if key not in self.clients:
            self.clients[key] = AgentClient(m.found, self.secret)
        return self.clients[key]

    def event(self, kind: str, **detail):
        row = {"time": time.time(), "event": kind, **detail}
        with open(self.events, "a") as f:
            f.write(json.dumps(row) + "\n")
        text = " ".join(f"{k}={v}" for k, v in detail.items())
        self.log(f"[launch] {kind} {text}")

    # ------------------------------------------------------------ data
    def write_shards(self, config: TrainConfig):
        self.state.data_files = cut_shards(config, self.state.num_shards, self.run_dir / "shards", self.log)

    def ship(self, m: Member):
        """Send the member's shard files the agent does not hold yet, in checksummed chunks."""
        files = self.state.data_files.get(str(m.worker_id), {})
        folder = self.run_dir / "shards" / f"worker-{m.worker_id}"
        agent, sent = self.client(m), 0
        for name, digest in files.items():
            if agent.request("has_blob", digest=digest)["present"]:
                continue
            path = folder / name
            size = path.stat().st_size
            with open(path, "rb") as f:
                offset = 0
                while offset < size:
                    data = f.read(protocol.CHUNK)
                    agent.request("put_chunk", digest=digest, offset=offset, size=size, data=data)
                    offset += len(data)
            sent += size
        if sent:
            self.event("shipped", worker=m.worker_id, host=m.host, bytes=sent)

    # ------------------------------------------------------------ start, watch, recover
    def start(self, resume_step):
        members = self.state.members
        agents = [self.client(m).hello() for m in members]
        order, addresses, links = plan_ring(agents, [m.address for m in members])
        members = self.state.members = [members[i] for i in order]
        ports = [self.client(m).request("prepare", job=self.state.job)["port"] for m in members]
        hostfile = [[f"{a}:{p}"] for a, p in zip(addresses, ports)]
        config = {**self.state.config, "workers": len(members)}
        for m in members:
            self.ship(m)
        for rank, m in enumerate(members):
            files = self.state.data_files.get(str(m.worker_id))
            self.client(m).request(
                "start", job=self.state.job, rank=rank, worker_id=m.worker_id, config=config, hostfile=hostfile,
                resume_step=resume_step, collective_timeout=float(self.options.collective_timeout),
                data={"files": files, "num_shards": self.state.num_shards} if files else {})
        self.state.save(self.run_dir)
        self.event("started", workers=len(members), resume_step=resume_step,
                   ring=" -> ".join(f"{m.host or m.address}({link})" for m, link in zip(members, links)))
        self.started_at = time.time()
        return False  # not done: now watch it

    def run(self, resume: bool = False) -> dict:
        """Start (or re-attach to) the job and see it through to the end."""
        if self.state.finished:
            self.log(f"job {self.state.job} already finished")
            return self.summary()
        done = self.reattach() if resume else self.start(resume_step=None)
        while not done:
            failure = self.watch()
            done = failure is None or self.recover(failure)
        self.state.finished = True
        self.state.save(self.run_dir)
        return self.summary()

    def reattach(self) -> bool:
        """After a launcher restart: adopt the workers if they all still run, else restart them.
        True if the job turned out to be finished."""
        try:
            states = [self.client(m).request("status", job=self.state.job, metrics_from=0,
                                             log_from=protocol.NO_LOG) for m in self.state.members]
        except AgentError as e:
            return self.recover(f"agent unreachable on re-attach ({e})")
        if all(s["state"] == "running" for s in states) or all(s.get("returncode") == 0 for s in states):
            self.event("reattached", workers=len(states))
            self.started_at = time.time()
            return False
        return self.recover("workers not running on re-attach")

    def watch(self):
        """Poll every agent until the job ends (None) or fails (a description of what failed)."""
        config = TrainConfig.from_dict(self.state.config)
        bar = tqdm(total=config.steps, desc=f"{config.strategy} x{len(self.state.members)} (cluster)",
                   file=sys.stderr, dynamic_ncols=True)
        last_ok = {m.worker_id: time.time() for m in self.state.members}
        seen = 0  # rank 0's metrics lines mirrored since the (re)start
        try:
            while True:
                time.sleep(0.5)
                states = {}
                for m in self.state.members:
                    try:
                        states[m.worker_id] = self._poll(m, metrics_from=seen if m is self.state.members[0] else 0)
                        last_ok[m.worker_id] = time.time()
                    except AgentError as e:
                        if time.time() - last_ok[m.worker_id] > self.options.heartbeat_timeout:
                            return {"lost": [m.worker_id], "why": f"agent of worker {m.worker_id} ({m.host}) silent "
                                    f"for {self.options.heartbeat_timeout:.0f} s: {e}"}
                rank0 = states.get(self.state.members[0].worker_id)
                if rank0:
                    seen += len(rank0.get("metrics", []))
                    self._mirror(rank0.get("metrics", []))
                failure = self._failure(states)
                if failure:
                    return failure
                progress = [s["progress"] for s in states.values() if s.get("progress")]
                if progress:
                    bar.n = min(p["step"] for p in progress)
                    bar.set_postfix_str("  ".join(
                        f"w{m.worker_id} {s['progress']['loss']:.3f} {s['progress']['tokens_per_s']:,.0f}tok/s "
                        f"sync {s['progress']['sync_s']:.1f}s sent {human_bytes(s['progress'].get('bytes_sent', 0))}"
                        for m in self.state.members
                        if (s := states.get(m.worker_id)) and s.get("progress")))
                    bar.refresh()
                if states and len(states) == len(self.state.members) and \
                        all(s["state"] == "exited" and s["returncode"] == 0 for s in states.values()):
                    return None
        finally:
            bar.close()

    def _poll(self, m: Member, metrics_from: int) -> dict:
        """One heartbeat: the worker's state, rank 0's new metrics lines, and the worker's new output,
        appended to RUN/logs/worker-K.log (whose size says how much has been copied)."""
        log = self.run_dir / "logs" / f"worker-{m.worker_id}.log"
        have = log.stat().st_size if log.exists() else 0
        status = self.client(m).request("status", job=self.state.job, metrics_from=metrics_from, log_from=have)
        with open(log, "ab") as f:
            f.write(status.get("log", b""))
        return status

    def _failure(self, states: dict):
        """What went wrong, if anything. When one worker dies its peers fail right after it (their ring
        collective raises), so the likely cause is named: a signal death or a stall before a watchdog
        exit, a watchdog exit before a plain error exit."""
        now, found = time.time(), []  # (rank of the cause, description)
        for m in self.state.members:
            s = states.get(m.worker_id)
            if s is None:
                continue
            who = f"worker {m.worker_id} ({m.host})"
            p = s.get("progress")
            if s["state"] == "unknown":
                found.append((1, f"the agent of {who} no longer knows the job"))
            elif s["state"] == "exited" and s["returncode"] < 0:
                found.append((0, f"{who} failed: it was killed by signal {-s['returncode']}"))
            elif s["state"] == "exited" and s["returncode"] != 0 and s.get("watchdog"):
                found.append((2, f"{who} failed: its collective watchdog fired (a peer stalled)"))
            elif s["state"] == "exited" and s["returncode"] != 0:
                found.append((3, f"{who} failed: it exited with code {s['returncode']}: "
                                 f"{(s['log_tail'].strip().splitlines() or ['(no output)'])[-1]}"))
            elif s["state"] == "running" and p and p["age_s"] > self.options.collective_timeout:
                found.append((1, f"{who} stalled: no step for {p['age_s']:.0f} s"))
            elif s["state"] == "running" and not p and now - self.started_at > self.options.startup_timeout:
                found.append((1, f"{who} did not start training within {self.options.startup_timeout:.0f} s"))
        return {"lost": [], "why": min(found)[1]} if found else None

    def _mirror(self, lines: list):
        last = self._last_step()
        with open(self.metrics.path, "a") as f:
            for line in lines:
                row = json.loads(line)
                if last is None or row["step"] > last:
                    f.write(line + "\n")
                    last = row["step"]

    def _last_step(self):
        if not self.metrics.path.exists():
            return None
        rows = MetricsLog.read(self.metrics.path)
        return rows[-1]["step"] if rows else None

    def recover(self, failure):
        """Stop the round everywhere and restart from the newest checkpoint every worker holds.
        True if there is nothing left to restart (the workers had all finished training)."""
        if isinstance(failure, str):
            failure = {"lost": [], "why": failure}
        self.event("failure", why=failure["why"])
        self.state.restarts += 1
        if self.state.restarts > self.options.max_restarts:
            raise JobFailed(f"gave up after {self.options.max_restarts} restarts; last failure: {failure['why']}")
        lost = set(failure["lost"])
        for m in self.state.members:
            try:
                self.client(m).request("stop", job=self.state.job)
            except AgentError:
                lost.add(m.worker_id)
            self.clients.pop((m.address, m.port), None)
        if lost and self.options.on_loss == "shrink":
            self.state.members = [m for m in self.state.members if m.worker_id not in lost]
            if not self.state.members:
                raise JobFailed("no machine of the job is left")
            self.event("shrunk", lost=sorted(lost), workers=len(self.state.members))
        elif lost:
            self._wait_for(lost)
        step = self._common_checkpoint()
        if step == self.state.config["steps"]:  # every worker holds the final checkpoint: nothing to redo
            self._mirror_all()
            self.event("finished", step=step)
            return True
        self.metrics.truncate_after(step if step is not None else -1)
        return self.start(resume_step=step)

    def _mirror_all(self):
        try:
            self._mirror(self._poll(self.state.members[0], metrics_from=0).get("metrics", []))
        except AgentError:
            pass  # rank 0's machine is gone: its last rows with it

    def _wait_for(self, lost: set):
        waiting = [m for m in self.state.members if m.worker_id in lost]
        self.event("waiting", workers=sorted(lost))
        while waiting:
            time.sleep(2)
            for m in list(waiting):
                try:
                    self.client(m).request("heartbeat")
                    waiting.remove(m)
                except AgentError:
                    self.clients.pop((m.address, m.port), None)

    def _common_checkpoint(self):
        """The newest checkpoint step that every member's worker holds (None: start over)."""
        common = None
        for m in self.state.members:
            steps = set(self.client(m).request("checkpoints", job=self.state.job)["steps"].get(str(m.worker_id), []))
            common = steps if common is None else common & steps
        return max(common) if common else None

    def summary(self) -> dict:
        rows = MetricsLog.read(self.metrics.path) if self.metrics.path.exists() else []
        last = rows[-1] if rows else {}
        summary = {"run_dir": str(self.run_dir), "job": self.state.job, "strategy": last.get("strategy"),
                   "workers": len(self.state.members), "steps": last.get("step"), "tokens": last.get("tokens"),
                   "final_eval_loss": last.get("eval_loss"), "restarts": self.state.restarts,
                   "bytes_sent_per_worker": last.get("bytes_sent_per_worker"), "utilisation": last.get("utilisation"),
                   "compute_s": last.get("compute_s"), "wall_s": last.get("wall_s")}
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        return summary
