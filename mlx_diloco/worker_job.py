"""A worker's job: what one `mlx-diloco worker` process trains, and where, as one JSON file.

Two programs start workers: `sim --processes K` (training/processes.py, K processes on this
machine) and a cluster's agent (cluster/agent.py, one worker per machine). Both write a WorkerJob,
and the worker reads it (`mlx-diloco worker --job FILE`). Which rank a process is and where its
peers listen are MLX's: MLX_RANK and MLX_HOSTFILE in its environment (for jaccl MLX_IBV_DEVICES
and MLX_JACCL_COORDINATOR). MLX-free: the agent writes it.
"""

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from .options import ConfigError, from_dict, read_json

STOPPED_FOR_CHANGE = 75  # a worker's exit code once it has saved its state for a membership change (EX_TEMPFAIL)

FIX = ("pass the job file that sim or an agent wrote, or write one: a JSON object of WorkerJob's keys "
       "(mlx_diloco/worker_job.py)")


class JobFile:
    """A frozen dataclass kept as one JSON file: what a program writes for a process it starts, which
    that process reads. A subclass names itself (`WHAT`, its keys `WHAT` keys) and says how to get a
    good file (`FIX`)."""
    WHAT, KEY, FIX = "job file", "job key", FIX

    def write(self, path: Path):
        """The job as JSON; a key left at None is left out (read gives it back as None)."""
        Path(path).write_text(json.dumps({k: v for k, v in asdict(self).items() if v is not None}, indent=1))

    @classmethod
    def read(cls, path):
        """The job in file `path`, or one ConfigError line naming the file and what is wrong in it."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{cls.WHAT} {path} does not exist; {cls.FIX}")
        params = read_json(path, f"a {cls.WHAT}", cls.FIX)
        if isinstance(params, dict) and (missing := [f.name for f in fields(cls)
                                                     if f.default is MISSING and f.name not in params]):
            raise ConfigError(f"{cls.WHAT} {path} lacks {', '.join(map(repr, missing))}; {cls.FIX}")
        try:  # an unknown key gets a did-you-mean, a value of the wrong type a valid example
            return from_dict(cls, params, what=cls.KEY)
        except ConfigError as e:
            raise ConfigError(f"{cls.WHAT} {path}: {e}") from None


@dataclass(frozen=True)
class WorkerJob(JobFile):
    config: dict                       # the run's config, flat (TrainConfig.to_dict())
    run_dir: str                       # folder for metrics and checkpoints (written by rank 0)
    own_run_dir: bool = False          # the run folder is this worker's alone: checkpoint into it whatever the rank
    data_dir: str = None               # a shard folder shipped by the launcher (default: read the config's data)
    data_worker: int = None            # which shard this worker trains (default: its rank)
    num_shards: int = None             # how many shards the data was cut into (default: the workers)
    resume_step: int = None            # resume from this step's checkpoint (default: a new run)
    workers_per_process: int = 1       # simulated workers this process trains (sim --processes; 1 on a cluster)
    collective_timeout: float = 60.0   # seconds a collective may wait for peers before this worker exits
    backend: str = "ring"              # MLX's backend between the workers: ring, or jaccl (RDMA over Thunderbolt 5)
    progress: str = None               # a JSON file rewritten every step (step, loss, tokens/s, sync time)
    sim_pid: int = None                # a process of sim's: sim's process id (it exits once sim is gone); sim
                                       # reports the data's warnings and the summary itself
    # An elastic cluster job (issue 24): the ring holds the job's current members only.
    ring_slots: list = None            # the slot (worker id, data shard) of each rank (default: the rank)
    membership: str = None             # who joined and left so far, membership.py's syntax (default: the config's)
    joiners: list = None               # slots that join at this start, taking the job's state from a member
    control: str = None                # a file the agent writes to make this worker save its state and exit

    @property
    def simulated(self) -> bool:
        return self.sim_pid is not None
