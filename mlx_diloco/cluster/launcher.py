"""`mlx-diloco launch`: run a job on the agents of a real cluster, and keep it running.

1. Connect to the chosen agents (found over mDNS or listed), check versions.
2. Ship each worker its data shard (content-addressed: a restart resends nothing).
3. Order the ring (by the links the agents measured, `--measure-links` or `mlx-diloco links`, when
   every pair has a measurement; else Thunderbolt between neighbours where cabled), write the
   hostfile and RUN/ring.json, start the workers through their agents.
4. Watch: every agent is polled twice a second (the heartbeat). Rank 0's metrics are mirrored
   into this run folder's metrics.jsonl, so `mlx-diloco plot` compares cluster and sim runs.
5. On a failure (a worker exits, stalls, or its agent stops answering), for a strategy that syncs
   every H steps (an elastic job): every worker saves its own state at the end of the step it is in
   (or resumes from the one it saved before the exchange it waits in), and a new ring of the machines
   that remain starts from those states: nobody loses the inner steps they took but the lost worker.
   A machine that answers again, or one named with --add, joins at the next sync point, taking the
   job's state from a member over the ring (training/elastic.py). Below --min-workers (all of them
   with `--on-loss wait`) the job waits for its lost machines. Other strategies restart every worker
   from the newest checkpoint they all hold.

Everything the launcher knows is in RUN/launch.json, so `launch --resume --run-dir RUN` after a
launcher crash re-attaches to the running workers, or restarts them from their checkpoints.
"""

import json
import queue
import secrets
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from .. import hub, run_status
from ..atomic import atomic_write_text
from ..records import EVENT, HOP, PROGRESS, ROW, STATUS, STOP, run_summary
from ..schedule import SyncSchedule
from ..config import ConfigError, TrainConfig
from ..training.metrics import MetricsLog, human_bytes
from ..worker_job import STOPPED_FOR_CHANGE, WorkerJob
from .launch_options import LaunchOptions
from . import protocol
from .backend import Plan, machine_problem, plan, start_fields
from . import discovery
from .discovery import AgentClient, AgentError, Found, parse_hosts, watch
from .hostfile import MlxHostfile
from .linktests import measure_all, pair_summaries
from .ringplan import plan_ring, ring_hops


@dataclass
class Member:
    """One machine of the job and the data shard its worker trains."""
    address: str
    port: int
    worker_id: int
    host: str = ""
    lost: bool = False  # out of the ring since its machine stopped answering (not yet back)

    @property
    def found(self) -> Found:
        return Found(self.address, self.port)


@dataclass
class JobState:
    """What launch.json holds."""
    job: str
    config: dict
    members: list
    num_shards: int
    options: dict             # LaunchOptions
    data_files: dict = field(default_factory=dict)   # worker_id -> {file name: sha256}
    restarts: int = 0
    last_failure: str = ""    # the last failure's words, when no machine was lost: the same again is not retried
    finished: bool = False
    elastic: bool = False     # the strategy syncs every H steps: membership changes keep the workers' steps
    membership: str = ""      # who left and joined so far (membership.py's syntax; '': the config's schedule)
    spares: list = field(default_factory=list)    # machines of the job outside the ring (lost, left, added)
    joining: list = field(default_factory=list)   # slots that join at the next start, from a member's state
    change: dict = field(default_factory=dict)    # the membership change under way: what and its clock
    mlx_hostfile: dict = field(default_factory=dict)  # the MLX hostfile of --hostfile: machines, ring, RDMA devices

    def save(self, run_dir: Path):
        atomic_write_text(run_dir / "launch.json", json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: Path) -> "JobState":
        path = run_dir / "launch.json"
        if not path.exists():
            raise ConfigError(f"no launch.json in {run_dir}: nothing to resume; drop --resume to start a job")
        state = cls(**json.loads(path.read_text()))
        state.members = [Member(**m) for m in state.members]
        state.spares = [Member(**m) for m in state.spares]
        return state


RESTARTS = ("membership_change", "restarted")  # events whose total_s is time the job did not train


def job_strategy(config: TrainConfig):
    """The strategy a job's config names, as its workers build it (its options as resolved)."""
    from ..strategies import make_strategy  # (MLX, on call: the launcher's planning imports without it)
    return make_strategy(config.strategy, config.strategy_options)


def grid_of(strategy) -> int:
    """Every how many steps the job's workers sync (0: every step, or when workers report (quorum
    rounds): a blocked worker is in an exchange). Streaming fragments' staggered syncs are not on
    it: a worker blocked in one shows as waiting."""
    return strategy.sync_every if strategy.syncs_every_h else 0


def sync_grid(config: dict) -> int:
    """grid_of the strategy a job's config (a dict, as launch.json keeps it) names, with its default H
    when not given."""
    return grid_of(job_strategy(TrainConfig.from_dict(config)))


def is_elastic(strategy) -> bool:
    """Whether workers may come and go between the strategy's syncs, which fall every H steps."""
    return strategy.steps_can_differ and bool(strategy.sync_every) and strategy.syncs_every_h


class JobFailed(Exception):
    pass


def check_bounds(options: LaunchOptions, workers: int):
    """--min-workers and --max-workers around --workers, or one line saying which to change."""
    if not 1 <= options.min_workers <= workers:
        raise ConfigError(f"--min-workers must be between 1 and --workers ({workers}), got {options.min_workers}")
    if options.max_workers and options.max_workers < workers:
        raise ConfigError(f"--max-workers ({options.max_workers}) is below --workers ({workers}); raise it, or drop "
                          "it to let the job grow back to --workers")


def with_room_to_grow(config: TrainConfig, max_workers: int, elastic: bool) -> tuple:
    """--max-workers above --workers: the job gets a slot (a worker id and its data shard) for each
    worker it may grow to, and the slots above --workers start out of it, waiting for machines to
    join. Returns the config over all the slots and the membership history that says so."""
    if max_workers <= config.workers:
        return config, ""
    if not elastic:
        raise ConfigError(f"--max-workers needs a strategy that syncs every H steps (diloco, streaming, ...), "
                          f"not {config.strategy}; drop --max-workers")
    if config.membership:
        raise ConfigError("--max-workers and --membership both say who trains when; drop one of them")
    return replace(config, workers=max_workers), ",".join(f"0:-{w}" for w in range(config.workers, max_workers))


def planned_members(config: TrainConfig, step: int) -> list:
    """The slots the config's membership schedule has as members at `step` (all without one)."""
    from ..membership import Schedule, Timeline
    schedule = Schedule.of(config)
    if schedule is None:
        return list(range(config.workers))
    return sorted(Timeline(schedule, sync_every=1, offsets=[0], steps=config.steps).members(step))


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
        offered = offered_memory(a)
        if need["total"] <= offered:
            continue
        fix = make_it_fit(shape, o, offered)
        hint = (f"pass {flags(o, fix)} (about {human_bytes(estimate(shape, fix)['total'])})" if fix
                else "choose a smaller model preset")
        raise ConfigError(f"{a['host']} offers {human_bytes(offered)} for training but one worker of this job needs "
                          f"about {human_bytes(need['total'])} (model {config.model}, {o.describe()}); {hint}, "
                          "or leave that machine out")


def offered_memory(agent: dict) -> float:
    """The bytes a machine offers training jobs (its hello): what its agent says, else 90% of its memory."""
    return agent.get("training_memory") or 0.9 * agent.get("memory", 0)


def check_model_here(model: str):
    """The launcher reads the model too (to tokenize the data and estimate memory): refuse, in one
    line, when this machine lacks it, rather than download it here."""
    if hub.names_files(model) and hub.local_folder(model) is None:
        raise ConfigError(f"this machine (the launcher) lacks model {model}, which it reads to tokenize the data "
                          f"and estimate memory; {hub.how_to_get(model)} here too")


def has_model(client: AgentClient, model: str) -> bool:
    """Whether the agent's machine holds the model where its jobs may load it (allowed.py); one
    ConfigError line when its owner does not let jobs load models from there."""
    try:
        answer = client.request("has_model", model=model)
    except AgentError:  # it stopped answering since its hello: it cannot run the job either
        return False
    if answer.get("refused"):
        raise ConfigError(f"agent at {client.found.endpoint}: {answer['refused']}")
    return answer["present"]


def check_model(model: str, agents: list, clients: list):
    """Refuse, before anything starts, a job whose model folder (or cached hub model) some of the
    machines lack: each Mac loads it from its own disk. Name every one of them, and the fix."""
    if not hub.names_files(model):
        return
    lacking = [a["host"] for a, c in zip(agents, clients) if not has_model(c, model)]
    if lacking:
        raise ConfigError(f"model {model} is missing on {', '.join(lacking)} (each Mac loads it from its own disk); "
                          f"{hub.how_to_get(model)} on each of them, or leave them out")


def reach(found: list, secret: bytes, wanted: int, log=print) -> tuple:
    """The first `wanted` agents of `found` that answer (discovery.reach), or one line saying so."""
    reachable, agents, clients = discovery.reach(found, secret, wanted, log=lambda m: log(f"[launch] {m}"))
    if len(reachable) < wanted:
        raise ConfigError(f"{wanted} workers wanted but {len(reachable)} agents answered; start more "
                          "agents (mlx-diloco agent), pass --hosts, or lower --workers")
    return reachable, agents, clients


def plan_start(backend_flag: str, agents: list, addresses: list, mlx_hostfile: dict) -> Plan:
    """The ring and backend of a start (cluster/backend.py): the ring plan_ring orders along the
    agents' Thunderbolt links, or the one an MLX hostfile (--hostfile) describes."""
    mlx_file = MlxHostfile.from_json(mlx_hostfile, "of this job") if mlx_hostfile else None
    return plan(backend_flag, agents, addresses, plan_ring(agents, addresses), mlx_file)


def dry_run(found: list, secret: bytes, workers: int, backend_flag: str, mlx_file: MlxHostfile = None,
            log=print) -> str:
    """What `launch` would do on these machines, without starting anything (`launch --dry-run`):
    the backend and why, each rank's machine, addresses and RDMA devices, and the MLX hostfile
    it would write to RUN/hostfile.json."""
    reachable, agents, _ = reach(found, secret, workers, log)
    p = plan_start(backend_flag, agents, [f.address for f in reachable], mlx_file.to_json() if mlx_file else {})
    envs = mlx_file.envs if mlx_file else []
    return (f"{p.describe(agents)}\nRUN/hostfile.json (mlx.launch --hostfile reads it; each rank's port is "
            f"chosen by its agent at the start):\n{json.dumps(p.mlx_hostfile(envs).to_json(), indent=4)}\n"
            "nothing was started (--dry-run)")


class Launcher:
    def __init__(self, state: JobState, run_dir: Path, secret: bytes, log=print, strategy=None):
        """`strategy`: the job's, as resolve built it (else built here from launch.json's config)."""
        self.state, self.run_dir, self.secret, self.log = state, Path(run_dir), secret, log
        self.options = LaunchOptions(**state.options)
        self.config = TrainConfig.from_dict(state.config)  # the job's config over all its slots, parsed once
        self.strategy = strategy or job_strategy(self.config)  # asked what it needs (built once)
        self.clients = {}
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.exchanges = MetricsLog(self.run_dir / "exchanges.jsonl")  # rank 0's, mirrored as its metrics are
        self.events = self.run_dir / "events.jsonl"
        self.restart_s = sum(e[EVENT.total_s] for e in self._events() if e[EVENT.event] in RESTARTS)
        self.status = run_status.StatusWriter(self.run_dir, "launch")  # what the dashboard shows of each worker
        self.step_rate, self.shown, self.offered = run_status.StepRate(), {}, {}
        self.sync_grid = SyncSchedule(grid_of(self.strategy))
        self.last_steps = {}      # each worker's last reported step: where a lost one left
        self.pending_join = None  # a machine admitted at the next sync point
        self.discovered = queue.SimpleQueue()  # agents that appeared on mDNS (discovery.watch's thread)
        (self.run_dir / "logs").mkdir(exist_ok=True)  # each worker's output, copied as it comes

    # ------------------------------------------------------------ setup
    @classmethod
    def new(cls, config: TrainConfig, found: list, run_dir: Path, secret: bytes, options: LaunchOptions, log=print,
            mlx_file: MlxHostfile = None):
        from ..training.resolve import resolve
        check_bounds(options, config.workers)
        check_model_here(config.model)
        run_dir, resolved = Path(run_dir), resolve(config)
        config = resolved.config  # the workers are sent it as resolved: the launcher says its notes
        for note in resolved.notes:
            log(f"[launch] {note}")
        elastic = is_elastic(resolved.strategy)
        grown, history = with_room_to_grow(config, options.max_workers, elastic)
        if (run_dir / "launch.json").exists():
            raise ConfigError(f"{run_dir} already holds a job; pass --resume to continue it, or another --run-dir")
        reachable, agents, clients = reach(found, secret, config.workers, log)
        check_model(config.model, agents, clients)
        check_memory(config, resolved.strategy, agents)
        mlx_hostfile = mlx_file.to_json() if mlx_file else {}
        plan_start(options.backend, agents, [f.address for f in reachable], mlx_hostfile)  # --backend jaccl: now
        if mlx_file and mlx_file.envs:
            log(f"[launch] the hostfile's envs ({' '.join(mlx_file.envs)}) are not passed to the workers (an agent "
                "starts nothing but its worker); set them in each agent's environment")
        members = [Member(f.address, f.port, worker_id=w, host=a["host"])
                   for w, (f, a) in enumerate(zip(reachable, agents))]  # start() orders the ring
        job = f"{run_dir.name[:40]}-{secrets.token_hex(3)}".replace(" ", "_")
        config = grown
        state = JobState(job, config.to_dict(), members, config.workers, asdict(options), elastic=elastic,
                         membership=history, mlx_hostfile=mlx_hostfile)
        # A planned schedule starts with its first members; the other machines wait for their slots' turn.
        first = planned_members(config, 0)
        state.members, state.spares = [m for m in members if m.worker_id in first], \
            [m for m in members if m.worker_id not in first]
        state.spares += [Member(f.address, f.port, worker_id=-1, host=f.endpoint)
                         for f in parse_hosts(options.add, protocol.DEFAULT_PORT)]
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        launcher = cls(state, run_dir, secret, log, strategy=resolved.strategy)
        if not options.data_on_workers:
            launcher.write_shards(config)
        state.save(run_dir)
        return launcher

    def client(self, m: Member) -> AgentClient:
        key = (m.address, m.port)
        if key not in self.clients:
            # A sleeping Mac must not hold a poll past the heartbeat timeout (a 4 MB chunk takes 3 s at 10 Mbit/s).
            self.clients[key] = AgentClient(m.found, self.secret, timeout_s=self.options.heartbeat_timeout + 1)
        return self.clients[key]

    def event(self, kind: str, **detail):
        row = EVENT.check({EVENT.time: time.time(), EVENT.event: kind, **detail})
        self.restart_s += detail[EVENT.total_s] if kind in RESTARTS else 0
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
        self.offered = {m.worker_id: offered_memory(a) for m, a in zip(members, agents)}
        ring = plan_start(self.options.backend, agents, [m.address for m in members], self.state.mlx_hostfile)
        order, addresses, links = ring.order, ring.addresses, ring.links
        members = self.state.members = [members[i] for i in order]
        ports = [self.client(m).request("prepare", job=self.state.job)["port"] for m in members]
        hostfile = [[f"{a}:{p}" for a in listens] for listens, p in zip(addresses, ports)]
        # The worker's job (worker_job.py), but where things are on its machine: its agent says that.
        job = WorkerJob({**self.state.config, "workers": len(members)}, collective_timeout=self.options.collective_timeout,
                        backend=ring.backend)
        resume = {m.worker_id: resume_step for m in members}
        if self.state.elastic:  # the config keeps the job's slots; the ring holds the members
            resume = self._own_states()
            job = replace(job, config=self.state.config, ring_slots=[m.worker_id for m in members],
                          joiners=self.state.joining, membership=self.state.membership)
        for m in members:
            self.ship(m)
        for rank, m in enumerate(members):
            files = self.state.data_files.get(str(m.worker_id)) or {}
            worker = replace(job, data_worker=m.worker_id, resume_step=resume[m.worker_id],
                             num_shards=self.state.num_shards if files else None)
            try:
                self.client(m).request("start", job=self.state.job, rank=rank, hostfile=hostfile,
                                       worker=worker.for_agent(), files=files, **start_fields(ring, ports[0]))
            except AgentError as e:  # a refusal (what its owner does not allow) or an agent gone: said in one line
                self._stop(members[:rank])
                raise JobFailed(str(e)) from None
        if self.state.change:  # a restart or membership change: started now (launch.json keeps it for --resume)
            self.state.change["started_at"] = time.time()
        self.state.save(self.run_dir)
        # The ring in MLX's format: `mlx.launch --hostfile RUN/hostfile.json` runs on the same machines.
        ring.mlx_hostfile(self.state.mlx_hostfile.get("envs", [])).write(self.run_dir / "hostfile.json")
        self.write_ring(agents, ring)
        self.event("started", workers=len(members), resume_step=resume if self.state.elastic else resume_step,
                   ring=" -> ".join(f"{m.host or m.address}({link})" for m, link in zip(members, links)),
                   backend=ring.backend, backend_reason=ring.reason)
        self.started_at = time.time()
        return False  # not done: now watch it

    def measure_links(self):
        """--measure-links: time the link of every pair of the job's machines (links.py) before the first
        start; the agents keep the results, by which start() orders the ring."""
        measured = measure_all([m.found for m in self.state.members], self.secret,
                               timeout_s=self.options.collective_timeout, log=self.log)
        self.event("links_measured", pairs=pair_summaries(measured))

    def write_ring(self, agents: list, ring: Plan):
        """RUN/ring.json: this start's ring, one hop per rank (the one from rank r-1): its machine, where it
        listens, the link's kind and its kept measurement (Gbit/s of bus bandwidth, latency; null without)."""
        addresses = [listens[0] for listens in ring.addresses]
        hops = [{HOP.rank: r, HOP.worker: m.worker_id, HOP.host: m.host or m.address, HOP.address: addresses[r], **hop}
                for r, (m, hop) in enumerate(zip(self.state.members, ring_hops(agents, ring.order, addresses)))]
        atomic_write_text(self.run_dir / "ring.json", json.dumps(hops, indent=1))

    def _own_states(self) -> dict:
        """The step each member resumes from (None: it starts afresh, a joiner or a new job): its newest
        saved state. With exchanges that overlap inner steps, the newest state every member holds
        instead: a worker that stalled may be behind an exchange the others started, and the ring must
        pair each worker's exchanges with the same ones of the others. A job whose members did not all
        save a state yet starts again from the beginning."""
        held = {m.worker_id: set(self.client(m).request("checkpoints", job=self.state.job)["steps"]
                                 .get(str(m.worker_id), []))
                for m in self.state.members if m.worker_id not in self.state.joining}
        if self.strategy.schedule.delay:  # exchanges in flight across steps
            common = set.intersection(*held.values()) if held else set()
            held = {w: common for w in held}
        if not all(held.values()):
            return {m.worker_id: None for m in self.state.members}
        return {m.worker_id: max(held[m.worker_id]) if m.worker_id in held else None for m in self.state.members}

    def run(self, resume: bool = False) -> dict:
        """Start (or re-attach to) the job and see it through to the end."""
        if self.state.finished:
            self.log(f"job {self.state.job} already finished")
            return self.summary()
        if self.options.measure_links and not resume:
            self.measure_links()
        done = self.reattach() if resume else self.start(resume_step=None)
        if self.state.elastic and self.options.discover:
            threading.Thread(target=watch, args=(self.discovered.put,), daemon=True).start()
        while not done:
            failure = self.watch()
            if failure is None:
                done = True
            elif failure.get("stopped"):  # every worker saved its state for a membership change
                done = self.change_members(failure["stopped"])
            else:
                done = self.recover(failure)
        self.state.finished = True
        self.state.save(self.run_dir)
        return self.summary()

    def reattach(self) -> bool:
        """After a launcher restart: adopt the workers if they all still run, else restart them.
        True if the job turned out to be finished."""
        try:
            states = [self.client(m).request("status", job=self.state.job, metrics_from=0,
                                             exchanges_from=protocol.NO_LOG, log_from=protocol.NO_LOG)
                      for m in self.state.members]
            self.offered = {m.worker_id: offered_memory(self.client(m).hello()) for m in self.state.members}
        except AgentError as e:
            return self.recover(f"agent unreachable on re-attach ({e})")
        if all(s["state"] == "running" for s in states) or all(s.get("returncode") == 0 for s in states):
            self.event("reattached", workers=len(states))
            self.started_at = time.time()
            return False
        if all(s.get("returncode") == STOPPED_FOR_CHANGE for s in states):  # the launcher died during a change
            self.event("reattached", workers=len(states), during="a membership change")
            return self.change_members({m.worker_id: s["progress"][PROGRESS.stopped]
                                        for m, s in zip(self.state.members, states)})
        return self.recover("workers not running on re-attach")

    def watch(self):
        """Poll every agent until the job ends (None) or fails (a description of what failed)."""
        bar = tqdm(total=self.config.steps, desc=f"{self.config.strategy} x{len(self.state.members)} (cluster)",
                   file=sys.stderr, dynamic_ncols=True)
        last_ok = {m.worker_id: time.time() for m in self.state.members}
        seen = seen_exchanges = 0  # rank 0's metrics and exchanges lines mirrored since the (re)start
        next_look = time.time()  # machines to admit: looked for every 2 s
        try:
            while True:
                time.sleep(0.5)
                states = {}
                for m in self.state.members:
                    try:
                        rank0 = m is self.state.members[0]
                        states[m.worker_id] = self._poll(m, metrics_from=seen if rank0 else 0,
                                                         exchanges_from=seen_exchanges if rank0 else protocol.NO_LOG)
                        last_ok[m.worker_id] = time.time()
                    except AgentError as e:
                        if time.time() - last_ok[m.worker_id] > self.options.heartbeat_timeout:
                            return {"lost": [m.worker_id], "why": f"agent of worker {m.worker_id} ({m.host}) silent "
                                    f"for {self.options.heartbeat_timeout:.0f} s: {e}"}
                rank0 = states.get(self.state.members[0].worker_id)
                if rank0:
                    seen += len(rank0.get("metrics", []))
                    seen_exchanges += len(rank0.get("exchanges", []))
                    self._mirror(rank0.get("metrics", []))
                    self._mirror(rank0.get("exchanges", []), self.exchanges)
                self._show(states)
                failure = self._failure(states)
                if failure:
                    return failure
                progress = [s["progress"] for s in states.values() if s.get("progress")]
                self.last_steps.update({w: s["progress"][PROGRESS.step] for w, s in states.items() if s.get("progress")})
                self._note_first_steps(progress)
                if states and len(states) == len(self.state.members) and \
                        all(s["state"] == "exited" and s["returncode"] == STOPPED_FOR_CHANGE for s in states.values()):
                    return {"stopped": {w: s["progress"][PROGRESS.stopped] for w, s in states.items()}}
                if self.state.elastic and time.time() > next_look:
                    self.look_for_joiners()
                    next_look = time.time() + 2
                if progress:
                    bar.n = min(p[PROGRESS.step] for p in progress)
                    bar.set_postfix_str("  ".join(
                        f"w{m.worker_id} {p[PROGRESS.loss]:.3f} {p[PROGRESS.tokens_per_s]:,.0f}tok/s "
                        f"sync {p[PROGRESS.sync_s]:.1f}s sent {human_bytes(p.get(PROGRESS.bytes_sent, 0))}"
                        for m in self.state.members
                        if (s := states.get(m.worker_id)) and (p := s.get("progress"))))
                    bar.refresh()
                if states and len(states) == len(self.state.members) and \
                        all(s["state"] == "exited" and s["returncode"] == 0 for s in states.values()):
                    return None
        finally:
            bar.close()

    def _poll(self, m: Member, metrics_from: int, exchanges_from: int = protocol.NO_LOG) -> dict:
        """One heartbeat: the worker's state, rank 0's new metrics and exchanges lines, and the worker's
        new output, appended to RUN/logs/worker-K.log (whose size says how much has been copied)."""
        log = self.run_dir / "logs" / f"worker-{m.worker_id}.log"
        have = log.stat().st_size if log.exists() else 0
        status = self.client(m).request("status", job=self.state.job, metrics_from=metrics_from,
                                        exchanges_from=exchanges_from, log_from=have)
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
            elif s["state"] == "exited" and s["returncode"] == STOPPED_FOR_CHANGE:
                continue  # saved its state for a membership change: the others follow
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

    def _mirror(self, lines: list, log: MetricsLog = None):
        """Append rank 0's lines to this folder's copy (metrics.jsonl, or `log`) that it lacks: those of
        later steps than its last, and of that step those not in it (one step's exchanges may come in
        two polls). After a restart the lines come again from the start of rank 0's file."""
        log = log or self.metrics
        if not lines:
            return
        have = [line for line in log.path.read_text().splitlines() if line.strip()] if log.path.exists() else []
        last = json.loads(have[-1])[ROW.step] if have else None  # (an exchange row's step: the same key)
        at_last = {line for line in have if json.loads(line)[ROW.step] == last}
        with open(log.path, "a") as f:
            for line in lines:
                step = json.loads(line)[ROW.step]
                if last is None or step > last or (step == last and line not in at_last):
                    f.write(line + "\n")
                    at_last = at_last if step == last else set()
                    last = step
                    at_last.add(line)

    # ------------------------------------------------------------ status.json (the dashboard)
    def _show(self, states: dict):
        """RUN/status.json (run_status.py) from one poll of the members (`states`: the answers): each
        worker's machine, state, step rate, tokens/s, memory against what its machine offers."""
        self._write_status([self._row(m, states.get(m.worker_id)) for m in self.state.members])

    def _show_all(self, state: str, lost=()):
        """While the ring is down (a restart, a change, a wait for lost machines): every member in
        `state`, those of `lost` lost, each with what it reported last."""
        self._write_status([{**self.shown.get(m.worker_id, {STATUS.worker: m.worker_id, STATUS.host: m.host or m.address}),
                             STATUS.state: "lost" if m.worker_id in lost else state} for m in self.state.members],
                           force=True)

    def _write_status(self, rows: list, force: bool = False):
        """The members' rows (in ring order, with their ranks), then the machines out of the ring: lost,
        or waiting to join."""
        rows = [{**row, STATUS.rank: rank} for rank, row in enumerate(rows)]
        spares = [{STATUS.worker: m.worker_id if m.worker_id >= 0 else None, STATUS.host: m.host or m.address,
                   STATUS.state: "lost" if m.lost else "waiting"}
                  for m in self.state.spares]
        step = min((r[STATUS.step] for r in rows if r.get(STATUS.step) is not None), default=0)
        self.status.write(step, self.config.steps, rows + spares, force=force)

    def _row(self, m: Member, status) -> dict:
        """A member's row from its poll (None: its agent did not answer), over what it reported before."""
        row = {**self.shown.get(m.worker_id, {}), STATUS.worker: m.worker_id, STATUS.host: m.host or m.address,
               STATUS.memory_limit_bytes: self.offered.get(m.worker_id), STATUS.restart_s: self.restart_s}
        p = status and status.get("progress")
        if p:
            row.update({STATUS.step: p[PROGRESS.step], STATUS.loss: p[PROGRESS.loss],
                        STATUS.tokens_per_s: p[PROGRESS.tokens_per_s],
                        STATUS.steps_per_s: self.step_rate(m.worker_id, p[PROGRESS.time], p[PROGRESS.step]),
                        **run_status.passed(p)})
        row[STATUS.state] = self._state_of(status, p, row.get(STATUS.steps_per_s))
        self.shown[m.worker_id] = row
        return row

    def _state_of(self, status, progress, steps_per_s) -> str:
        """What a member's worker is doing (run_status.STATES). One whose last step is older than three
        of its step times (2 s at least) is blocked in a collective: syncing if the step it is in
        ends at a sync point (or its strategy syncs off a grid of H steps), else waiting on a peer."""
        if status is None or status["state"] == "unknown":
            return "lost"
        if status["state"] == "exited":
            return {0: "done", STOPPED_FOR_CHANGE: "restarting"}.get(status["returncode"], "failed")
        if not progress:
            return "starting"
        if progress.get(PROGRESS.stopped):
            return "restarting"
        if progress["age_s"] > max(2.0, 3 / (steps_per_s or 1)):
            grid = self.sync_grid
            return "syncing" if not grid.every or grid.syncs(progress[PROGRESS.step] + 1) else "waiting"
        return "training"

    def _truncate_mirrors(self, step: int):
        """The rows after `step` are redone by the restarted ring: drop them from the copies."""
        self.metrics.truncate_after(step)
        self.exchanges.truncate_after(step)

    def recover(self, failure):
        """Stop the round everywhere and restart from the newest checkpoint every worker holds.
        True if there is nothing left to restart (the workers had all finished training)."""
        if isinstance(failure, str):
            failure = {"lost": [], "why": failure}
        self.event("failure", why=failure["why"])
        self._show_all("restarting", lost=failure["lost"])
        self.state.restarts += 1
        if self.state.restarts > self.options.max_restarts:
            raise JobFailed(f"gave up after {self.options.max_restarts} restarts; last failure: {failure['why']}")
        if not failure["lost"] and failure["why"] == self.state.last_failure:  # a restart would fail so again
            raise JobFailed(f"the same failure twice in a row, not retried: {failure['why']}")
        self.state.last_failure = "" if failure["lost"] else failure["why"]
        if self.state.elastic:
            return self._recover_keeping_steps(failure)
        self._begin_change("restart")  # its cost is reported once every worker steps again
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
        if step == self.config.steps:  # every worker holds the final checkpoint: nothing to redo
            self._mirror_all()
            self.event("finished", step=step)
            return True
        self._truncate_mirrors(step if step is not None else -1)
        self.state.change["stopped_at"] = time.time()
        return self.start(resume_step=step)

    # ------------------------------------------------------------ membership changes (elastic jobs)
    def _held(self) -> set:
        return {m.worker_id for m in self.state.members}

    def _recover_keeping_steps(self, failure: dict) -> bool:
        """Every worker saves its own state and exits; the machines that answer form the next ring, each
        worker resuming from its own state. A lost machine's slot leaves (its round is lost; its shard
        waits for a joiner), or, below --min-workers, the job waits for it to answer again."""
        self._begin_change("lost")
        self.pending_join = None  # looked for again once the ring runs
        lost = self._save_and_stop(set(failure["lost"]))
        if lost:
            fewest = len(self.state.members) if self.options.on_loss == "wait" else self.options.min_workers
            if len(self.state.members) - len(lost) < max(1, fewest):
                self._wait_for(lost)  # they resume from their own states
            else:
                self._leave([m for m in self.state.members if m.worker_id in lost])
        return self._restart_from_own_states()

    def _save_and_stop(self, lost: set) -> set:
        """Ask every worker to save its state at the end of its step and exit; stop those that have not
        after the grace period (they wait on a lost peer, and resume from the state they saved before
        that exchange). Returns the workers whose machines no longer answer."""
        for m in self.state.members:
            if m.worker_id not in lost:
                try:
                    self.client(m).request("save_and_exit", job=self.state.job, when="now", after=0)
                except AgentError:
                    lost.add(m.worker_id)
        deadline = time.time() + self.options.stop_grace
        waiting = [m for m in self.state.members if m.worker_id not in lost]
        while waiting and time.time() < deadline:
            time.sleep(0.2)
            waiting = [m for m in waiting if self._still_running(m) and not self._saved_all_it_did(m)]
        for m in waiting:
            self.log(f"[launch] worker {m.worker_id} ({m.host}) did not save within {self.options.stop_grace:g} s: "
                     "it resumes from the newest state it saved")
        for m in self.state.members:
            if m.worker_id not in lost:  # a lost machine's agent would keep us waiting for its timeout
                try:
                    self.client(m).request("stop", job=self.state.job)
                except AgentError:
                    lost.add(m.worker_id)
            self.clients.pop((m.address, m.port), None)
        self.state.change["stopped_at"] = time.time()
        return lost

    def _stop(self, members: list):
        """Stop the members' workers, those whose agents answer."""
        for m in members:
            try:
                self.client(m).request("stop", job=self.state.job)
            except AgentError:
                pass

    def _still_running(self, m: Member) -> bool:
        """Whether its worker still runs; notes the last step it reported."""
        try:
            status = self.client(m).request("status", job=self.state.job, metrics_from=0,
                                            exchanges_from=protocol.NO_LOG, log_from=protocol.NO_LOG)
        except AgentError:
            return False
        if status.get("progress"):
            self.last_steps[m.worker_id] = status["progress"][PROGRESS.step]
        return status["state"] == "running"

    def _saved_all_it_did(self, m: Member) -> bool:
        """Whether the worker holds a state saved at the last step it reported: it waits in an exchange
        (with a lost peer it never returns from), having saved before it; stopping it loses nothing."""
        try:
            held = self.client(m).request("checkpoints", job=self.state.job)["steps"].get(str(m.worker_id), [])
        except AgentError:
            return False
        return bool(held) and max(held) >= self.last_steps.get(m.worker_id, 0)

    def _leave(self, lost: list):
        """The lost machines' slots leave the job from the step after the last one each reported."""
        for m in lost:
            step = self.last_steps.get(m.worker_id, 0) + 1
            self._record(step, f"-{m.worker_id}")
            self.state.members.remove(m)
            self.state.spares.append(m)
            m.lost = True
            self.event("left", worker=m.worker_id, host=m.host, step=step, workers=len(self.state.members))

    def _record(self, step: int, what: str):
        """Add `step:what` to the job's membership history, in step order."""
        history = (self.state.membership or self.config.membership
                   or f"0:{self.state.num_shards}").split(",")
        at = next((i for i, e in enumerate(history) if int(e.split(":")[0]) > step), len(history))
        self.state.membership = ",".join(history[:at] + [f"{step}:{what}"] + history[at:])

    def look_for_joiners(self):
        """While the ring has room and a free slot, admit a machine that answers (a lost one, one named
        with --add, or one new on mDNS) at the next sync point: ask every member to save and exit there."""
        while not self.discovered.empty():
            f = self.discovered.get()
            if (f.address, f.port) not in {(m.address, m.port) for m in self.state.members + self.state.spares}:
                self.state.spares.append(Member(f.address, f.port, worker_id=-1, host=f.endpoint))
        cap = self.options.max_workers or self.state.num_shards
        free = sorted(set(range(self.state.num_shards)) - self._held())
        if self.pending_join or len(self.state.members) >= cap or not free or not self._can_admit():
            return
        for m in list(self.state.spares):
            if self._ready_to_join(m):
                m.worker_id = m.worker_id if m.worker_id in free else free[0]
                self.pending_join = m
                after = max(self.last_steps.values(), default=0) + 2  # a step no member has reached
                self._begin_change("join")
                for member in self.state.members:
                    self.client(member).request("save_and_exit", job=self.state.job, when="at_sync", after=after)
                self.event("joining", worker=m.worker_id, host=m.host, after_step=after)
                return

    def _can_admit(self) -> bool:
        """Whether the job admits machines mid-run: not with a planned schedule (it decides who joins
        when), nor when each worker keeps state of its own (exchanges in flight across steps, error
        feedback: a joiner could take no part in it)."""
        return not (self.config.membership or self.strategy.own_state)

    def _ready_to_join(self, m: Member) -> bool:
        """Whether machine `m` answers, runs this version and holds the model. A machine that answers
        but cannot take part (another mlx-diloco version, another cluster's secret, no jaccl with
        --backend jaccl) is refused once, in an event naming why and the fix, and left out."""
        try:
            client = AgentClient(m.found, self.secret, timeout_s=0.5)  # (a sleeping Mac must not hold up the watch)
            agent = client.hello()
            if self.options.backend == "jaccl" and (why := machine_problem(agent)):
                raise ConfigError(f"--backend jaccl: {why}")
            if hub.names_files(self.config.model) and not has_model(client, self.config.model):
                return False
            client.request("stop", job=self.state.job)  # a worker of this job still running there (it slept)
        except ConfigError as e:
            self.state.spares.remove(m)
            self.event("refused", host=m.host, why=str(e))
            return False
        except AgentError:
            return False
        m.host = agent["host"]
        self.clients[(m.address, m.port)] = client
        return True

    def change_members(self, stopped: dict) -> bool:
        """Every member saved its state at the same step for a membership change: the machine asked to
        join joins, or the members the schedule plans from the next step on form the ring."""
        self._show_all("restarting")
        step = max(info[STOP.step] for info in stopped.values())
        self.last_steps.update({int(w): info[STOP.step] for w, info in stopped.items()})
        if not self.state.change:
            self._begin_change("planned")
        # The change costs from the moment the first worker stopped training (a joiner waits for a sync point).
        self.state.change["began"] = min(info[STOP.time] for info in stopped.values())
        self.state.change["stopped_at"] = max(info[STOP.time] for info in stopped.values())
        joiner, self.pending_join = self.pending_join, None
        if joiner:
            self._record(step, f"+{joiner.worker_id}")
            self._join(joiner)
        elif self.config.membership:  # (else a join asked for before a launcher restart: looked for again)
            planned = set(next(iter(stopped.values()))[STOP.members])
            for m in [m for m in self.state.members if m.worker_id not in planned]:
                self.state.members.remove(m)
                self.state.spares.append(m)
                self.event("left", worker=m.worker_id, host=m.host, step=step + 1, workers=len(self.state.members))
            for slot in sorted(planned - self._held()):
                spare = next((m for m in self.state.spares if m.worker_id == slot and self._ready_to_join(m)), None)
                if spare is None:
                    raise JobFailed(f"the membership schedule admits worker {slot} after step {step}, but its "
                                    "machine does not answer")
                self._join(spare)
        return self._restart_from_own_states()

    def _join(self, m: Member):
        m.lost = False
        self.state.spares.remove(m)
        self.state.members.append(m)
        self.state.joining.append(m.worker_id)
        self.event("joined", worker=m.worker_id, host=m.host, workers=len(self.state.members))

    def _begin_change(self, kind: str):
        self.state.change = {"kind": kind, "began": time.time()}

    def _restart_from_own_states(self) -> bool:
        """Start the ring of the members from their own states (True: they had all finished)."""
        self.state.save(self.run_dir)
        steps = self._own_states()
        if all(s == self.config.steps for w, s in steps.items() if w not in self.state.joining):
            self._mirror_all()
            self.event("finished", step=self.config.steps)
            return True
        self.state.change["redone_steps"] = {str(w): self.last_steps.get(w, 0) - s for w, s in steps.items()
                                             if s is not None and w in self.last_steps}
        self._truncate_mirrors(min([s for s in steps.values() if s is not None], default=-1))
        return self.start(resume_step=None)

    def _note_first_steps(self, progress: list):
        """Once every worker of a new ring has taken a step: the change (or the restart) is over; report
        its cost."""
        change = self.state.change
        if not change or "started_at" not in change or len(progress) < len(self.state.members):
            return
        now, began = time.time(), change["began"]
        self.event("restarted" if change["kind"] == "restart" else "membership_change", change=change["kind"],
                   workers=len(self.state.members),
                   stop_s=round(change["stopped_at"] - began, 2), start_s=round(change["started_at"] -
                                                                                 change["stopped_at"], 2),
                   first_step_s=round(now - change["started_at"], 2), total_s=round(now - began, 2),
                   redone_steps=change.get("redone_steps", {}))
        self.state.change, self.state.joining = {}, []
        self.state.save(self.run_dir)

    def _mirror_all(self):
        try:
            rank0 = self._poll(self.state.members[0], metrics_from=0, exchanges_from=0)
            self._mirror(rank0.get("metrics", []))
            self._mirror(rank0.get("exchanges", []), self.exchanges)
        except AgentError:
            pass  # rank 0's machine is gone: its last rows with it

    def _wait_for(self, lost: set):
        waiting = [m for m in self.state.members if m.worker_id in lost]
        self.event("waiting", workers=sorted(lost))
        self._show_all("waiting", lost=lost)
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

    def _events(self) -> list:
        return [json.loads(line) for line in self.events.read_text().splitlines()] if self.events.exists() else []

    def summary(self) -> dict:
        """The job's summary (records.SUMMARY, as sim's): rank 0's last metrics row, and what the launcher
        knows of the job (its restarts and changes); what only the workers know (the model) is None."""
        rows = MetricsLog.read(self.metrics.path) if self.metrics.path.exists() else []
        last = rows[-1] if rows else {}
        same = (ROW.strategy, ROW.tokens, ROW.examples, ROW.tokens_per_shard, ROW.inner_steps_lost,
                ROW.bytes_sent_per_worker, ROW.peak_exchange_bytes, ROW.compute_s, ROW.utilisation,
                ROW.measured_utilisation, ROW.busy_s, ROW.link_s, ROW.straggler_s, ROW.mfu, ROW.flops_per_token,
                ROW.peak_gflops, ROW.peak_memory_bytes, ROW.workers_per_process, ROW.wall_s)
        summary = run_summary(
            **{key: last.get(key) for key in same}, run_dir=str(self.run_dir), job=self.state.job,
            workers=len(self.state.members), steps=last.get(ROW.step), final_eval_loss=last.get(ROW.eval_loss),
            modelled_comm_s=last.get(ROW.comm_s), restarts=self.state.restarts, restart_s=self.restart_s,
            changes=[e for e in self._events() if e[EVENT.event] in RESTARTS])
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=1))
        return summary
