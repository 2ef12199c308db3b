"""A worker's job: what one `mlx-diloco worker` process trains, and where, as one JSON file.

Two programs start workers: `sim --processes K` (training/processes.py, K processes on this
machine) and a cluster's agent (cluster/agent.py, one worker per machine). Both write a WorkerJob,
and the worker reads it (`mlx-diloco worker --job FILE`). Which rank a process is and where its
peers listen are MLX's: MLX_RANK and MLX_HOSTFILE in its environment (for jaccl MLX_IBV_DEVICES
and MLX_JACCL_COORDINATOR). MLX-free: the agent writes it.
"""

import json
from dataclasses import MISSING, asdict, dataclass, fields
from functools import cached_property
from pathlib import Path

from .config import TrainConfig
from .options import ConfigError, from_dict, read_json

STOPPED_FOR_CHANGE = 75  # a worker's exit code once it has saved its state for a membership change (EX_TEMPFAIL)

FIX = ("pass the job file that sim or an agent wrote, or write one: a JSON object of WorkerJob's keys "
       "(mlx_diloco/worker_job.py)")


class JobFile:
    """A frozen dataclass kept as one JSON file: what a program writes for a process it starts, which
    that process reads. A subclass names itself (`WHAT`, its keys `WHAT` keys), says how to get a
    good file (`FIX`), the keys it cannot do without (`REQUIRED`, besides those without a default),
    and checks its values (`check`)."""
    WHAT, KEY, FIX, REQUIRED = "job file", "job key", FIX, ()

    def write(self, path: Path):
        """The job as JSON; a key left at None is left out (read gives it back as None)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def check(self):
        """One ConfigError line for a value out of its range (the types are checked on reading)."""

    @classmethod
    def read(cls, path):
        """The job in file `path`, or one ConfigError line naming the file and what is wrong in it."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{cls.WHAT} {path} does not exist; {cls.FIX}")
        return cls.parse(read_json(path, f"a {cls.WHAT}", cls.FIX), f"{cls.WHAT} {path}")

    @classmethod
    def parse(cls, params, where: str):
        """The job that `params` (its JSON) describes, checked, or one ConfigError line saying what
        is wrong in `where`: what the file's reader and the agent that writes it both run."""
        if isinstance(params, dict) and (missing := [f.name for f in fields(cls) if f.name not in params and (
                f.name in cls.REQUIRED or f.default is MISSING and f.default_factory is MISSING)]):
            raise ConfigError(f"{where} lacks {', '.join(map(repr, missing))}; {cls.FIX}")
        try:  # an unknown key gets a did-you-mean, a value of the wrong type a valid example
            job = from_dict(cls, params, what=cls.KEY)
            job.check()
            return job
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def _check(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


MAX_WORKERS = 4096  # worker ids (slots) are below it


@dataclass(frozen=True)
class WorkerJob(JobFile):
    """The one description of a worker, from `launch` (the agent's start request carries it, the
    agent adds where things are on its machine) and `sim --processes` to `Run.from_job`."""
    REQUIRED = ("run_dir",)
    config: dict                       # the run's config, flat (TrainConfig.to_dict())
    # Where things are on the worker's machine: set by the agent (or sim), never by a launcher (HOST_KEYS).
    run_dir: str = None                # folder for metrics and checkpoints (written by rank 0)
    own_run_dir: bool = False          # the run folder is this worker's alone: checkpoint into it whatever the rank
    data_dir: str = None               # a shard folder shipped by the launcher (default: read the config's data)
    progress: str = None               # a JSON file rewritten every step (step, loss, tokens/s, sync time)
    control: str = None                # a file the agent writes to make this worker save its state and exit
    sim_pid: int = None                # a process of sim's: sim's process id (it exits once sim is gone); sim
                                       # reports the data's warnings and the summary itself
    workers_per_process: int = 1       # simulated workers this process trains (sim --processes; 1 on a cluster)
    # What the launcher (or sim) decides.
    data_worker: int = None            # which shard this worker trains (default: its rank)
    num_shards: int = None             # how many shards the data was cut into (default: the workers)
    resume_step: int = None            # resume from this step's checkpoint (default: a new run)
    collective_timeout: float = 60.0   # seconds a collective may wait for peers before this worker exits
    backend: str = "ring"              # MLX's backend between the workers: ring, or jaccl (RDMA over Thunderbolt 5)
    # An elastic cluster job (issue 24): the ring holds the job's current members only.
    ring_slots: list = None            # the slot (worker id, data shard) of each rank (default: the rank)
    membership: str = None             # who joined and left so far, membership.py's syntax (default: the config's)
    joiners: list = None               # slots that join at this start, taking the job's state from a member

    HOST_KEYS = ("run_dir", "own_run_dir", "data_dir", "progress", "control", "sim_pid", "workers_per_process")

    @property
    def simulated(self) -> bool:
        return self.sim_pid is not None

    def for_agent(self) -> dict:
        """The job as a launcher's start request carries it: the agent places the files (HOST_KEYS)."""
        return {k: v for k, v in self.to_json().items() if k not in self.HOST_KEYS}

    @cached_property
    def train_config(self) -> TrainConfig:
        """The run's config, parsed once (on reading the job)."""
        return TrainConfig.from_dict(self.config)

    @property
    def ring_size(self) -> int:
        """The workers in the ring: the job's current members, else the config's workers."""
        return len(self.ring_slots) if self.ring_slots else self.config.get("workers", TrainConfig.workers)

    def check(self):
        slot = lambda w: isinstance(w, int) and not isinstance(w, bool) and 0 <= w < MAX_WORKERS  # noqa: E731
        _check(self.data_worker is None or slot(self.data_worker), f"data-worker must be below {MAX_WORKERS}")
        _check(0 < self.collective_timeout <= 86400, "collective-timeout must be between 0 and 86400 seconds")
        _check(self.resume_step is None or self.resume_step >= 0, "resume-step must be >= 0")
        _check(self.workers_per_process >= 1, "workers-per-process must be >= 1")
        _check(self.backend in ("ring", "jaccl"), "backend must be ring or jaccl")
        _check(self.ring_slots is None or (isinstance(self.ring_slots, list) and all(map(slot, self.ring_slots))
                                           and len(set(self.ring_slots)) == len(self.ring_slots)),
               "ring-slots must name one distinct worker id per rank")
        _check(self.joiners is None or (isinstance(self.joiners, list) and all(map(slot, self.joiners))),
               "joiners must be worker ids")
        try:
            self.train_config
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"invalid job config: {e}") from None
