"""`mlx-diloco launch`: set a job up on the agents of a real cluster and start it; the supervisor
(supervisor.py) keeps it running.

1. Connect to the chosen agents (found over mDNS or listed), check versions, the model on every
   machine and the memory a worker needs.
2. Ship each worker its data shard (content-addressed: a restart resends nothing).
3. Order the ring (by the links the agents measured, `--measure-links` or `mlx-diloco links`, when
   every pair has a measurement; else Thunderbolt between neighbours where cabled), write the
   hostfile and RUN/ring.json, start the workers through their agents.

Then the supervisor watches the ring, recovers it from failures and changes its membership (an
elastic job: a strategy that syncs every H steps), starting it again here each time.
Everything the launcher knows is in RUN/launch.json, so `launch --resume --run-dir RUN` after a
launcher crash re-attaches to the running workers, or restarts them from their checkpoints.
"""

import json
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .. import hub
from ..atomic import atomic_write_text
from ..config import ConfigError, TrainConfig
from ..objectives.kinds import kind
from ..records import EVENT, HOP
from ..training.metrics import human_bytes
from ..worker_job import WorkerJob
from . import discovery, protocol
from .backend import Plan, machine_problem, plan, start_fields
from .discovery import AgentClient, AgentError, Found, parse_hosts
from .hostfile import MlxHostfile
from .launch_options import LaunchOptions
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

    def record(self, step: int, what: str, planned: str):
        """Add `step:what` to the job's membership history (`planned`: the config's schedule), in step order."""
        history = (self.membership or planned or f"0:{self.num_shards}").split(",")
        at = next((i for i, e in enumerate(history) if int(e.split(":")[0]) > step), len(history))
        self.membership = ",".join(history[:at] + [f"{step}:{what}"] + history[at:])

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
REWARD_FILE = "rewards.py"  # a job's reward file, as it ships beside each worker's shard


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
    from ..schedules.membership import Schedule, Timeline
    schedule = Schedule.of(config)
    if schedule is None:
        return list(range(config.workers))
    return sorted(Timeline(schedule, sync_every=1, offsets=[0], steps=config.steps).members(step))


def cut_shards(config: TrainConfig, num_shards: int, folder: Path, log=print) -> dict:
    """Tokenize the corpus (or read the post-training pairs or prompts) here once and cut one shard per
    worker into folder/worker-K, without building the model. Returns {worker: {file name: sha256}},
    what the agents are sent."""
    from ..data.datasets import write_shard
    from ..data.post_training import write_post_training_shard
    from ..models.zoo import load_spec
    from ..training.resolve import load_data
    data = load_data(config, load_spec(config.model), log=log)
    write = write_post_training_shard if kind(config.objective).post_training else write_shard
    for w in range(num_shards):
        write(data, w, num_shards, folder / f"worker-{w}")
    return shard_files(folder, num_shards)


def shard_files(folder: Path, num_shards: int) -> dict:
    """{worker: {file name: sha256}} of the files in each folder/worker-K."""
    return {str(w): {str(p.relative_to(shard)): protocol.file_digest(p) for p in sorted(shard.rglob("*")) if p.is_file()}
            for w in range(num_shards) if (shard := folder / f"worker-{w}").is_dir()}


def check_reward_file(config: TrainConfig):
    """A reward file, loaded here before anything starts: one line for one that does not load, or lacks
    a function the config names (objectives/rewards.py), rather than a failure on every worker."""
    if config.reward_file:
        from ..objectives.rewards import Rewards
        Rewards(config)


def check_memory(config: TrainConfig, strategy, agents: list):
    """Refuse, before anything starts, a job whose worker will not fit on one of the machines:
    name the machine, the estimate, and the smallest change that makes it fit."""
    from ..machine.memory import estimate, flags, make_it_fit, worker_estimate
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
        self.events = self.run_dir / "events.jsonl"
        self.restart_s = sum(e[EVENT.total_s] for e in self.events_so_far() if e[EVENT.event] in RESTARTS)
        self.offered = {}       # each slot's memory its machine offers (the last start's hellos)
        self.started_at = self.first_started_at = None  # when the ring last started; first (by this launcher)
        (self.run_dir / "logs").mkdir(exist_ok=True)  # each worker's output, copied as it comes

    # ------------------------------------------------------------ setup
    @classmethod
    def new(cls, config: TrainConfig, found: list, run_dir: Path, secret: bytes, options: LaunchOptions, log=print,
            mlx_file: MlxHostfile = None):
        from ..training.resolve import resolve
        check_bounds(options, config.workers)
        check_model_here(config.model)
        run_dir, resolved = Path(run_dir), resolve(config)
        config = resolved.config  # the workers are sent it as resolved
        check_reward_file(config)
        elastic = is_elastic(resolved.strategy)
        grown, history = with_room_to_grow(config, options.max_workers, elastic)
        if (run_dir / "launch.json").exists():
            raise ConfigError(f"{run_dir} already holds a job; pass --resume to continue it, or another --run-dir")
        reachable, agents, clients = reach(found, secret, config.workers, log)
        check_model(config.model, agents, clients)
        check_memory(config, resolved.strategy, agents)
        mlx_hostfile = mlx_file.to_json() if mlx_file else {}
        plan_start(options.backend, agents, [f.address for f in reachable], mlx_hostfile)  # --backend jaccl: now
        for note in resolved.notes:  # once every check passed: a refusal is its one line
            log(f"[launch] {note}")
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
        launcher = cls(state, run_dir, secret, log, strategy=resolved.strategy)
        launcher.write_job_files(config, shards=not options.data_on_workers)
        (run_dir / "config.json").write_text(json.dumps(state.config, indent=1))
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
    def write_job_files(self, config: TrainConfig, shards: bool):
        """What each worker is sent, in RUN/shards/worker-K: its data shard (`shards`; else each machine
        reads the data from its own disk), and a reward file, the job's code, beside it as REWARD_FILE,
        which the job's config names then (an agent runs it only where its owner allows code: allowed.py)."""
        folder = self.run_dir / "shards"
        if shards:
            cut_shards(config, self.state.num_shards, folder, self.log)
        if config.reward_file:
            for w in range(self.state.num_shards):
                (folder / f"worker-{w}").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(config.reward_file, folder / f"worker-{w}" / REWARD_FILE)
            self.state.config = {**self.state.config, "reward_file": REWARD_FILE}
            self.config = replace(self.config, reward_file=REWARD_FILE)
        self.state.data_files = shard_files(folder, self.state.num_shards)

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

    # ------------------------------------------------------------ start
    def start(self, resume_step):
        """Start the job's ring: every member's worker, from `resume_step` (an elastic job's: each from
        its own newest state), through its agent. The supervisor (supervisor.py) watches it then."""
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
            resume = self.own_states()
            job = replace(job, config=self.state.config, ring_slots=[m.worker_id for m in members],
                          joiners=self.state.joining, membership=self.state.membership)
        def start(rank: int, m: Member, check_only: bool):
            files = self.state.data_files.get(str(m.worker_id)) or {}
            worker = replace(job, data_worker=m.worker_id, resume_step=resume[m.worker_id],
                             num_shards=self.state.num_shards if files else None)
            self.client(m).request("start", job=self.state.job, rank=rank, hostfile=hostfile, worker=worker.for_agent(),
                                   files=files, check_only=check_only, **start_fields(ring, ports[0]))
        try:  # every agent checks its start first (what its owner allows: the code a job names, its paths)
            for rank, m in enumerate(members):
                start(rank, m, check_only=True)
        except AgentError as e:  # a refusal, or an agent gone: said in one line, before anything ships or starts
            raise JobFailed(str(e)) from None
        for m in members:
            self.ship(m)
        for rank, m in enumerate(members):
            try:
                start(rank, m, check_only=False)
            except AgentError as e:  # an agent gone since its check: said in one line
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
        self.first_started_at = self.first_started_at or self.started_at

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

    def own_states(self) -> dict:
        """The step each member resumes from (None: it starts afresh, a joiner or a new job): its newest
        saved state. With exchanges that overlap inner steps, the newest state every member holds
        instead: a worker that stalled may be behind an exchange the others started, and the ring must
        pair each worker's exchanges with the same ones of the others. A job whose members did not all
        save a state yet starts again from the beginning."""
        held = {m.worker_id: set(self.held_steps(m)) for m in self.state.members if m.worker_id not in self.state.joining}
        if self.strategy.schedule.delay:  # exchanges in flight across steps
            common = set.intersection(*held.values()) if held else set()
            held = {w: common for w in held}
        if not all(held.values()):
            return {m.worker_id: None for m in self.state.members}
        return {m.worker_id: max(held[m.worker_id]) if m.worker_id in held else None for m in self.state.members}

    def ready_to_join(self, m: Member) -> bool:
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

    def held_steps(self, m: Member) -> list:
        """The steps of the states (checkpoints) member `m`'s worker holds on its machine."""
        return self.client(m).request("checkpoints", job=self.state.job)["steps"].get(str(m.worker_id), [])

    def _stop(self, members: list):
        """Stop the members' workers, those whose agents answer."""
        for m in members:
            try:
                self.client(m).request("stop", job=self.state.job)
            except AgentError:
                pass

    def events_so_far(self) -> list:
        """RUN/events.jsonl's events (records.EVENT)."""
        return [json.loads(line) for line in self.events.read_text().splitlines()] if self.events.exists() else []

    def write_summary(self, summary: dict):
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=1))
