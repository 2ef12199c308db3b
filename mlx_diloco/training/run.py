"""The training run: the same loop drives the simulator and a real cluster worker.

Which workers this process trains, and how they talk, come from the communicator; what it trains
comes from the config (resolve.py) or the caller (Parts). `Run.step()` takes one tick of the job,
read top to bottom: the local workers' inner step, the strategy's after_step (an outer step, an
exchange), the exchanges' cost (exchange/ledger.py), the reports to the callbacks (callbacks.py:
metrics files, progress bar and file, a user's logger), then the evaluation and the checkpoint
when they are due. `Run.train()` steps to the end.
"""

import json
import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..records import metrics_row, run_summary
from ..atomic import atomic_write_text
from ..config import ConfigError, TrainConfig
from ..data.datasets import BatchStream, ShardSampler, oversized_batch
from ..exchange.comm import Communicator, NonFiniteValues
from ..exchange.ledger import ExchangeLedger
from ..exchange.network import parse_link
from ..exchange.ring import init_ring
from ..exchange.worker_axis import flatten_workers, unflatten
from ..models.adapters import ADAPTERS, save_adapters
from ..models.checkpointing import checkpoint_blocks
from ..models.finetune import ADAPTER_TYPES, adapter_config, apply_fine_tune, is_quantized, trainable_count
from ..models.kernels import paths as kernel_paths
from ..models.precision import to_bf16
from ..memory import model_shape
from ..models.zoo import count_parameters
from ..objectives import make_objective
from ..objectives.rewards import RewardError
from ..run_folder import check_new_run_dir, latest_step
from ..utilisation import flops_per_token, mfu, peak_gflops
from ..worker_job import WorkerJob
from . import checkpoint
from .callbacks import Loggers, MetricsFile, ProgressBar, ProgressFile, StatusFile, check_loggers
from .metrics import MetricsLog
from .pacing import Pacing
from .resolve import Parts, parts_from_config, resolve, saved_config
from .workers import Workers, check_loss


class StoppedForChange(Exception):
    """This worker saved its state for a membership change; the launcher starts the job's next ring."""


class StopRequests:
    """What the launcher asks of an elastic cluster worker, in a JSON file its agent writes:
    {"stop": "now"}: save at the end of this step and exit (a member was lost: the others keep their
    steps); {"stop": "at_sync", "after": T}: the same at the first sync point from step T on (a
    machine joins there)."""

    def __init__(self, path):
        self.path = Path(path)

    def asked(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet (or being written: read again next step)
            return {}


@contextmanager
def memory_limit(gb: float):
    """MLX keeps to `gb` while training (0: MLX's default). MLX's CPU queues a graph's operations
    ahead of running them, allocating each output as it is queued: without a limit, a step can
    hold every intermediate at once (20 chained matmuls: 763 MB above the weights, 109 MB under a
    limit; docs/memory.md). Past the limit, MLX waits for queued work to finish first."""
    if not gb:
        yield
        return
    previous = mx.set_memory_limit(int(gb * 1e9))
    try:
        yield
    finally:
        mx.set_memory_limit(previous)


def model_flops_per_token(model, spec, config: TrainConfig):
    """Training FLOPs per token of the model as built (its adapters, if any, what trains), or None
    for a model that is not a transformer language model (utilisation.py)."""
    if spec is None or not spec.is_language_model:
        return None
    trainable = trainable_count(model) if config.fine_tune_type in ADAPTER_TYPES else None
    # memory.Shape's parameters: the base's, adapters apart (a quantized model's count leaves them out)
    base = count_parameters(model) - (0 if is_quantized(model) else trainable or 0)
    shape = replace(model_shape(spec.params, base), trainable=trainable)
    return flops_per_token(shape, config.seq_len, tied_head=not hasattr(model, "lm_head"))


def convert_model(model, config: TrainConfig):
    """The model as the config trains it: its fine-tune type (adapters, the base frozen), bf16
    weights, blocks checkpointed for memory (models/)."""
    apply_fine_tune(model, config)  # first: the adapters too are trained in the config's precision
    if config.precision == "bf16":
        to_bf16(model)
    if config.grad_checkpoint and not checkpoint_blocks(model):
        raise ConfigError("grad-checkpoint needs a model of transformer blocks (paths h.N or layers.N); "
                          "drop --grad-checkpoint")


def in_order_of(tree, saved):
    """`saved`, its dicts' keys in the order `tree` has them (a checkpoint reads back sorted)."""
    if isinstance(saved, dict) and isinstance(tree, dict):
        keys = [k for k in tree if k in saved] + [k for k in saved if k not in tree]
        return {k: in_order_of(tree.get(k), saved[k]) for k in keys}
    if isinstance(saved, (list, tuple)) and isinstance(tree, (list, tuple)) and len(saved) == len(tree):
        return type(saved)(in_order_of(t, v) for t, v in zip(tree, saved))
    return saved


def mean_of_numbers(values: list) -> float:
    """The mean of the values that are not NaN (a worker that took no step has a NaN loss); NaN if none."""
    numbers = [v for v in values if not math.isnan(v)]
    return sum(numbers) / len(numbers) if numbers else float("nan")


@dataclass
class Tick:
    """One tick's inner step, as `Run.end_step` takes it."""
    step: int                      # the job-wide step number (1-based)
    losses: mx.array = None        # each local worker's loss; None when all of them waited out the tick
    seconds: float = 0.0           # the inner step's wall time
    members: list = None           # which local workers are members (a membership schedule); None: all


class Run:
    """One training run in this process, over the workers `comm` says it hosts. `callbacks`:
    TrainingCallbacks that hear its reports, after the run's own (metrics files, progress)."""

    def __init__(self, config: TrainConfig, run_dir, comm: Communicator, reporter: bool = True,
                 resume: bool = False, log=print, job: WorkerJob = None, parts: Parts = None, callbacks=None):
        self.run_dir, self.comm, self.reporter, self.log = Path(run_dir), comm, reporter, log
        # A worker of a cluster or of sim's processes has its job (worker_job.py); the simulator, the defaults.
        self.job = job = job or WorkerJob(config={}, run_dir=str(run_dir))
        # Each process checkpoints the workers it hosts; rank 0 (or the simulator) in the run folder.
        self.checkpoint_dir = self.run_dir if reporter or job.own_run_dir else \
            self.run_dir / f"worker-{comm.local_workers[0]}"
        if resume:
            config = config or saved_config(self.checkpoint_dir)
        elif reporter:
            check_new_run_dir(self.run_dir)
        resolved = resolve(config) if parts is None else None
        self.config = config = resolved.config if resolved else config
        for note in resolved.notes if resolved and reporter else ():
            log(note)
        ring = len(job.ring_slots) if job.ring_slots else config.workers
        if comm.num_workers != ring:
            raise ConfigError(f"the job has {comm.num_workers} workers but the config says {ring}")
        # The slots (worker ids, data shards) of this process's workers.
        self.slots = [job.ring_slots[w] for w in comm.local_workers] if job.ring_slots else comm.local_workers
        if resolved is None:  # the caller's strategy (the API): checked against the config here
            config.check_strategy(parts.strategy)
        if reporter:  # report-to's packages, before any model or data is loaded
            check_loggers(config)
        parts = parts or parts_from_config(resolved, log, job.data_dir)
        self.spec, self.data, model = parts.spec, parts.data, parts.model
        convert_model(model, config)
        self.objective = make_objective(config, model, self.data, log)  # its reference: the model as it starts
        self.strategy = parts.strategy.bind(comm, config.steps)
        self.strategy.setup(model.trainable_parameters())
        self.pacing = Pacing(config, self.strategy, comm, self.slots, job.membership, log)
        # Evaluations every outer step of a periodic strategy (else every 50 steps); checkpoints too.
        period = self.strategy.sync_every
        self.eval_every = config.eval_every or period or 50
        self.checkpoint_every = period or self.eval_every
        # Checkpointed blocks are for memory: replicas one after another, so that passes can go
        # block by block (models/checkpointing.py), which vmap does not allow.
        # MLX cannot vmap a quantized base's matmul (QuantizedMatmul::vmap): QLoRA too.
        vectorize = False if config.grad_checkpoint or is_quantized(model) else parts.vectorize
        self.workers = Workers(model, comm.n_local, config, self.strategy.inner_optimizer(config),
                               clip=self.strategy.clip_gradients, vectorize=vectorize,
                               loss=self.objective.loss or parts.loss,
                               masked=self.data.masked_targets, log=log)
        self.data_workers = self.slots if job.data_worker is None else [job.data_worker]
        self.samplers = self._samplers(job.num_shards or config.workers)
        if reporter and not resume and (note := oversized_batch(config.batch_size, self.samplers)):
            log(note)
        self.eval_batches = self.objective.eval_batches(
            self.workers, self.data.eval_batches(config.batch_size, config.eval_batches))
        if parts.loss is not None:  # a user's loss, tried on one batch before the run folder exists
            with memory_limit(config.memory_limit):
                check_loss(parts.loss, model, *self.eval_batches[0])
        self.ledger = ExchangeLedger(parse_link(config.link))
        self.steps_done = 0
        self.compute_s = 0.0     # measured compute time of one worker
        self.waited_s = {"link_s": 0.0, "straggler_s": 0.0}  # before this process: a checkpoint's
        self._step_s = 0.0       # the last inner step's (a slow worker may wait out the first ticks)
        self._loss_sum, self._loss_count = self._no_train_losses()  # each local worker's, since the last evaluation
        self.wall_start = time.time()
        self.n_params = count_parameters(model)
        self.flops_per_token = model_flops_per_token(model, self.spec, config)
        self.peak_gflops = peak_gflops() if self.flops_per_token else None
        self.tokens_here = 0     # tokens this process trained (its MFU over its wall-clock time)
        if resume:
            self._restore()
        elif reporter:  # everything checked out: only now create the run folder
            self._create_run_folder()
        if job.ring_slots:  # an elastic cluster's ring
            self._catch_up(job.joiners or [])
        self.stop_requests = StopRequests(job.control) if job.control else None
        self.callbacks = self._own_callbacks(resume) + list(callbacks or [])

    @classmethod
    def from_job(cls, job: WorkerJob, log=print) -> "Run":
        """The run of one worker of a cluster job or of sim's processes, as its job says; its rank
        and peers from MLX's environment (exchange/ring.py)."""
        comm = init_ring(job.collective_timeout, job.workers_per_process, job.backend)
        return cls(job.train_config, job.run_dir, comm, reporter=comm.local_workers[0] == 0,
                   resume=job.resume_step is not None, log=log, job=job)

    def _samplers(self, num_shards: int) -> list:
        """Each local worker's cursor in its shard of the training data (batches given one by one:
        the stream is the cursor)."""
        if isinstance(self.data.train, BatchStream):
            return [self.data.train]
        return [ShardSampler(len(self.data.train), w, num_shards, self.config.seed, is_shard=self.data.is_shard)
                for w in self.data_workers]

    def _create_run_folder(self):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(self.config.to_dict(), indent=1))
        if self.data.tokenizer_dir:
            shutil.copytree(self.data.tokenizer_dir, self.run_dir / "tokenizer", dirs_exist_ok=True)

    def _own_callbacks(self, resume: bool) -> list:
        """The reporter writes the metrics files, shows a progress bar and feeds report-to's
        loggers; on a cluster, each worker's agent reads its progress file."""
        own = []
        if self.reporter:
            own += [MetricsFile(self.run_dir, exchanges=bool(self.strategy.sync_every),
                                resumed_at=self.steps_done if resume else None),
                    ProgressBar(f"{self.config.strategy} x{self.config.workers}")]
            if self.config.report_to:
                own.append(Loggers(self.config, self.run_dir))
        if self.job.progress:
            own.append(ProgressFile(self.job.progress))
        else:  # (a cluster's launcher writes the job's status.json from the progress files)
            own.append(StatusFile(self.checkpoint_dir, self.slots))
        return own

    def _report(self, hook: str, info: dict):
        for callback in self.callbacks:
            getattr(callback, hook)(info)

    # ------------------------------------------------------------ the loop
    def train(self, stop_after: int = None) -> dict:
        """Step to the configured step count (or stop after `stop_after` steps, for tests), with
        MLX held to the config's memory limit; the run's summary."""
        with memory_limit(self.config.memory_limit):
            self._report("on_train_begin", {"step": self.steps_done, "steps": self.config.steps})
            try:
                while self.steps_done < self.config.steps:
                    if self.stop_requests and (why := self._why_stop()):
                        self.save_local_state()
                        self._report_stop(why)
                        raise StoppedForChange(why)
                    self.step()
                    if stop_after is not None and self.steps_done >= stop_after:
                        break
            except BaseException:
                self._report("on_train_stopped", {"step": self.steps_done})
                raise
            self.peak_memory = self._peak_memory()  # the last global evaluation and checkpoint included
            summary = self.summary()
        self._report("on_train_end", summary)
        return summary

    def step(self, batch=None):
        """One tick of the job. `batch`: this process's (x, y), each with a leading axis over its
        workers (default: the next batch of each worker's shard)."""
        if self.stop_requests and self._meets_peers(self.steps_done + 1):
            self.save_local_state()  # a peer lost in the exchange ahead must not cost this worker its round
        self.end_step(self.inner_step(batch))

    def inner_step(self, batch=None) -> Tick:
        """The first half of `step`: the inner step of the local workers that step at this tick
        (speeds.py), timed. Until `end_step`, they hold their local parameters."""
        if self.steps_done == 0:  # the starting point of every curve
            self.evaluate(None, self._worker_losses(0))
        tick = Tick(self.steps_done + 1)
        tick.members = self.pacing.members(tick.step)
        x, y = batch or self.next_batch(tick.members)
        t0, wait0 = time.perf_counter(), self.comm.wait_s
        active = self.pacing.active(tick.step)
        if active is None or any(active):  # else this process's workers wait out the tick
            with self._stop_on_reward_error(tick.step):  # the objective's batch (GRPO: rollouts, rewards)
                x, y = self.objective.batch(self, x, y, tick)
            with self._stop_on_non_finite(tick.step):
                tick.losses = self.workers.step(x, y, self.strategy, tick.step, active)
            tick.seconds = time.perf_counter() - t0
            self._step_s = (tick.seconds - (self.comm.wait_s - wait0)) / self.comm.n_local  # DDP syncs inside the step
        else:
            self.workers.count_tick()
        return tick

    def end_step(self, tick: Tick):
        """The second half of `step`: the strategy's after_step, the cost of the exchanges that
        finished, the reports, and the evaluation and checkpoint when due."""
        c, t = self.config, tick.step
        self.steps_done = t
        self.compute_s += self.pacing.tick_seconds(c.step_time or self._step_s)
        evaluate = t % self.eval_every == 0 or t == c.steps
        # The local models are evaluated before the outer step replaces them with the global one.
        worker_losses = self._worker_losses(t) if evaluate else None
        self.pacing.weigh_sync(t)
        with self._stop_on_non_finite(t):
            self.workers.params = self.strategy.after_step(self.workers.take_params(), t)
        self.pacing.after_tick(t, self.compute_s)  # after the sync: the first round's, every worker stepped in it
        self._change_membership(t)
        # With overlap, only the time its overlapped inner steps do not hide counts.
        for row in self.ledger.record(t, self.comm.drain_records(), step_s=self.compute_s / t):
            self._report("on_sync_report", row)
        if tick.losses is not None:
            self._add_train_losses(tick)
            self._report("on_train_loss_report", self._train_info(tick))
        if evaluate:
            self.evaluate(self._loss_sum / self._loss_count, worker_losses)
            self._loss_sum, self._loss_count = self._no_train_losses()
        if t % self.checkpoint_every == 0 or t == c.steps:
            if not evaluate:  # a checkpoint keeps no global model that diverged since the last evaluation
                self._global_eval_loss()
            with self._stop_on_non_finite(t):
                self.save_checkpoint()

    def next_batch(self, members=None):
        """Each local worker's next batch, from its shard (or the stream of batches given one by one).
        `members` (a membership schedule): the others' shards wait for a joiner, and they are given a
        member's batch, which their masked step does not train on ((None, None) when there is none)."""
        if isinstance(self.data.train, BatchStream):
            xs, ys = zip(*self.data.train.next(self.data_workers, self.config.workers))
            return mx.array(np.stack(xs)), mx.array(np.stack(ys))
        members = members or [True] * len(self.samplers)
        batches = {i: self.data.train.get(s.next_indices(self.config.batch_size))
                   for i, s in enumerate(self.samplers) if members[i]}
        if not batches:
            return None, None
        xs, ys = zip(*(batches.get(i, next(iter(batches.values()))) for i in range(len(self.samplers))))
        return mx.array(np.stack(xs)), mx.array(np.stack(ys))

    def _worker_losses(self, step: int) -> mx.array:
        """Each local model's eval loss at `step`; NaN for a worker that is not a member then."""
        losses = self.workers.eval_each(self.eval_batches)
        members = self.pacing.members(step)
        return losses if members is None else mx.where(mx.array(members), losses, float("nan"))

    def _no_train_losses(self) -> tuple:
        """Each local worker's (sum, count) of train losses, before any (a worker with none: NaN)."""
        return mx.zeros((self.comm.n_local,)), mx.zeros((self.comm.n_local,))

    def _add_train_losses(self, tick: Tick):
        """Count this tick's losses of the workers that are members."""
        taken = mx.ones((self.comm.n_local,)) if tick.members is None else mx.array(tick.members, mx.float32)
        self._loss_sum = self._loss_sum + mx.where(taken > 0, tick.losses, 0)
        self._loss_count = self._loss_count + taken

    def _train_info(self, tick: Tick) -> dict:
        c = self.config
        losses = tick.losses if tick.members is None else tick.losses[mx.array(np.flatnonzero(tick.members))]
        tokens = c.batch_size * (self.data.tokens_per_example() or 1) * losses.size  # (or examples)
        job = self.pacing.member_count(tick.step)
        self.tokens_here += tokens
        trained = self.pacing.active(tick.step) or [True] * self.comm.n_local
        return {"step": tick.step, "steps": c.steps, "loss": float(losses.mean().item()),
                "worker_losses": [loss if t else None for loss, t in zip(tick.losses.tolist(), trained)],
                "tokens_per_s": tokens / tick.seconds, "job_tokens_per_s": tokens * job / losses.size / tick.seconds,
                "sync_s": self.comm.wait_s, "bytes_sent": self.ledger.bytes_sent, **self.time_spent(),
                "memory_bytes": mx.get_active_memory(), "memory_limit_bytes": int(c.memory_limit * 1e9) or None}

    def time_spent(self) -> dict:
        """Where this process's time went (seconds, over the job): computing its workers' inner steps,
        waiting for the link, waiting for slower workers (comm.py measures both waits); and its model
        FLOPs utilisation over its wall-clock time (utilisation.py)."""
        wall = time.time() - self.wall_start
        rate = self.tokens_here / wall if wall > 0 else None
        gflops = rate and self.peak_gflops and self.flops_per_token * rate / 1e9
        if gflops and gflops > self.peak_gflops:  # the peak was measured while other work ran (utilisation.py)
            self.peak_gflops = peak_gflops(beaten_by=gflops)
        return {"compute_s": self.compute_s * self.comm.n_local,
                "link_s": self.waited_s["link_s"] + self.comm.wait_s - self.comm.straggler_s,
                "straggler_s": self.waited_s["straggler_s"] + self.comm.straggler_s,
                "mfu": mfu(self.flops_per_token, rate, self.peak_gflops) if rate is not None else None}

    # ------------------------------------------------------------ membership
    def _change_membership(self, step: int):
        """Report the workers that leave or join at `step`; joiners take the global model and a
        member's inner optimizer state (membership.py), and step from the next step. On an elastic
        cluster a new ring makes the change (`_why_stop`, `_admit_joiners`)."""
        changes = self.pacing.changes_between(step - 1, step)
        if self.reporter:
            for change in changes:
                self.log(change.describe())
        joining = [c.worker for c in changes if c.joined]
        if joining and not self.stop_requests:
            self.workers.admit([w in joining for w in self.comm.local_workers], self.global_params(),
                               self._inner_state_of(self.pacing.peer(step)))

    def _inner_state_of(self, worker: int) -> dict:
        """Worker `worker`'s per-replica inner optimizer state ({path: value}, no worker axis), wherever
        it is trained: every process takes part in the gather."""
        state = [(k, v) for k, v in tree_flatten(self.workers.optimizer.state) if v.ndim]  # not the shared step, lr
        buffer, shapes = flatten_workers(tree_unflatten(state))
        row = self.comm.all_gather({"state": buffer}, tag="a joiner's inner optimizer state")["state"][worker]
        return dict(tree_flatten(unflatten(row, shapes)))

    # ------------------------------------------------------------ an elastic cluster's membership changes
    def _why_stop(self) -> str:
        """Why this cluster worker saves its state and exits after the step it just took, if it does:
        a change the schedule plans, or the launcher's request ('' when it goes on)."""
        t, asked = self.steps_done, self.stop_requests.asked()
        if self._ring_is_behind():
            return f"step {t}: the membership schedule changes the ring"
        if asked.get("stop") == "now":
            return f"step {t}: stopped by the launcher (a member was lost)"
        if asked.get("stop") == "at_sync" and t >= asked["after"] and self.pacing.is_sync_point(t):
            return f"step {t}: stopped by the launcher at a sync point (a machine joins)"
        return ""

    def _ring_is_behind(self) -> bool:
        """Whether the schedule plans a change the ring does not hold yet: a join admitted at this step,
        or a leave at the next."""
        ring = set(self.job.ring_slots or self.slots)
        return any((c.worker in ring) != c.joined for c in self.pacing.ring_changes(self.steps_done))

    def _meets_peers(self, step: int) -> bool:
        """Whether `step` waits on the other workers: an exchange starts or lands, or an evaluation
        or a checkpoint gathers them."""
        return (self.pacing.exchanges_at(step) or step % self.eval_every == 0 or step == self.config.steps
                or step % self.checkpoint_every == 0)

    def save_local_state(self):
        """This worker's own state (weights, moments, data cursor, the global model and outer state,
        an exchange in flight) on its own disk, with no collective: a peer may be gone. What it resumes
        from after a membership change, so it keeps the inner steps it took."""
        if latest_step(self.checkpoint_dir) != self.steps_done:
            arrays, meta = self.state()
            checkpoint.save(self.checkpoint_dir, self.steps_done, arrays, meta)  # empties `arrays` as it writes

    def _report_stop(self, why: str):
        """Tell the launcher (through the progress file its agent reads) where this worker stopped and
        who the members are from the next step on."""
        if not self.job.progress:
            return
        path = Path(self.job.progress)
        progress = json.loads(path.read_text()) if path.exists() else {}
        members = self.pacing.member_slots(self.steps_done + 1)
        atomic_write_text(path, json.dumps({**progress, "stopped": {"step": self.steps_done, "why": why,
                                                                    "members": members, "time": time.time()}}))

    def _catch_up(self, joiners: list):
        """Bring every worker of a new ring to the same round: the joiners, and a worker whose saved
        state is from before a sync that another's includes (it died after that exchange, before its
        checkpoint), take the job's state from a member (`_admit_joiners`); else the ring would pair
        its exchanges with other ones. Every process of the ring takes part."""
        steps = [int(s) for s in self.comm.gather_metric(mx.full((self.comm.n_local,), self.steps_done))]
        behind = [slot for slot, step in zip(self.job.ring_slots, steps)
                  if any(self.pacing.is_sync_point(t) for t in range(step + 1, max(steps) + 1))]
        for slot, step in zip(self.job.ring_slots, steps):
            if slot in behind and slot not in joiners and slot in self.slots:
                self.log(f"worker {slot}'s state (step {step}) is from before a sync the others took: it takes "
                         "the job's state from a member")
        if behind or joiners:
            self._admit_joiners(sorted(set(behind) | set(joiners)))

    def _admit_joiners(self, joiners: list):
        """Slots joining at this start take, over the ring from the lowest-numbered member (not from
        any disk: the launching Mac may hold nothing), the global model and outer optimizer state,
        that member's inner optimizer state, the step and the run's counters; and their shard's cursor
        where the slot's last worker left it. Every process of the ring takes part."""
        ring = self.job.ring_slots
        if self.strategy.own_state:
            raise ConfigError(f"a worker cannot join a {self.strategy.name} job whose workers each keep "
                              f"{self.strategy.own_state} of their own; start the job with every worker, or without it")
        peer = ring.index(min(set(ring) - set(joiners)))
        clock = {"counts": mx.array([self.steps_done, self.ledger.bytes_sent, self.ledger.peak_bytes], mx.int64),
                 "seconds": mx.array([self.compute_s, self.ledger.comm_s], mx.float32)}
        got = self.comm.broadcast({"strategy": self.strategy.state(), "inner": self.workers.optimizer.state,
                                   "clock": clock}, source=peer)
        if not set(self.slots) & set(joiners):
            return
        sent = sum(v.nbytes for _, v in tree_flatten(got))
        self.strategy.load_state(got["strategy"])
        self.workers.optimizer.state = in_order_of(self.workers.optimizer.state, got["inner"])
        self.workers.admit([True] * self.comm.n_local, self.global_params(), {})
        self.steps_done, self.ledger.bytes_sent, self.ledger.peak_bytes = got["clock"]["counts"].tolist()
        self.compute_s, self.ledger.comm_s = got["clock"]["seconds"].tolist()
        taken = self.pacing.steps_taken(self.steps_done)
        for sampler, slot in zip(self.samplers, self.data_workers):
            sampler.seek(taken[slot] * self.config.batch_size)
        self.log(f"worker {self.slots[0]} joined at step {self.steps_done}, from worker {ring[peer]}'s state "
                 f"({sent:,} bytes over the ring)")

    def _by_slot(self, values: list) -> list:
        """One value per slot, NaN where no member is, from one per ring worker (an elastic cluster's)."""
        if not self.job.ring_slots or values is None:
            return values
        out = [float("nan")] * self.config.workers
        for slot, value in zip(self.job.ring_slots, values):
            out[slot] = value
        return out

    @contextmanager
    def _stop_on_non_finite(self, step: int):
        """A worker that would send NaN or inf stops the run before its values reach any other
        worker or the global model (the communicator checks every exchange, and every worker
        learns of it at once); nothing is checkpointed after it, so the last checkpoint is intact."""
        try:
            yield
        except NonFiniteValues as e:
            raise ConfigError(f"step {step}: {e}: training diverged, and the run stops before they reach the "
                              f"global model ({self._kept()}); lower --lr or --outer-lr, or raise --warmup") from None

    @contextmanager
    def _stop_on_reward_error(self, step: int):
        """A reward function that fails mid-run stops the run before the step (objectives/rewards.py)."""
        try:
            yield
        except RewardError as e:
            raise ConfigError(f"step {step}: {e}; the run stops ({self._kept()})") from None

    def _global_eval_loss(self) -> float:
        """The global model's eval loss (the reporter's to compute; 0 in another process). A NaN or inf
        one is divergence (an outer step too large leaves the weights finite and the logits not): every
        process stops before the model is checkpointed."""
        loss = self.workers.eval_params(self.global_params(), self.eval_batches) if self.reporter else 0.0
        if not all(map(math.isfinite, self.comm.gather_metric(mx.full((self.comm.n_local,), loss)))):
            raise ConfigError(f"step {self.steps_done}: the global model's eval loss is not finite: training "
                              f"diverged, and the run stops before it is checkpointed ({self._kept()}); lower --lr or "
                              "--outer-lr, or raise --warmup")
        return loss

    def _kept(self) -> str:
        last = latest_step(self.checkpoint_dir)
        return f"its last checkpoint (step {last}) is intact" if last else "no checkpoint was written"

    # ------------------------------------------------------------ evaluation and metrics
    def examples(self) -> int:
        """Examples (sequences, images, rows) the workers have trained on so far."""
        return sum(self.examples_per_shard())

    def examples_per_shard(self) -> list:
        """Examples each worker's shard has given so far."""
        return [n * self.config.batch_size for n in self.pacing.steps_taken(self.steps_done)]

    def tokens(self):
        """Tokens the workers have trained on so far; None when the examples are not tokens."""
        per_example = self.data.tokens_per_example()
        return None if per_example is None else self.examples() * per_example

    def tokens_per_shard(self):
        per_example = self.data.tokens_per_example()
        return None if per_example is None else [n * per_example for n in self.examples_per_shard()]

    def global_params(self):
        return self.strategy.global_params(self.workers.params)

    def evaluate(self, train_losses, worker_losses):
        """Report a metrics row: the global model's eval loss, and each local model's (taken
        before the outer step, so the rows show how far the workers drifted apart). Every process
        evaluates its workers; the reporter gathers their losses and reports the row."""
        c, ledger = self.config, self.ledger
        worker_losses = self.comm.gather_metric(worker_losses)
        train_losses = None if train_losses is None else self.comm.gather_metric(train_losses)
        self.peak_memory = self._peak_memory()
        spent = self._job_time_spent()
        objective = self.objective.report(self)  # every process: it gathers the workers' values
        global_loss = self._global_eval_loss()
        if not self.reporter:
            return
        modelled = self.compute_s + ledger.comm_s
        idle = self.pacing.idle_fraction()
        self._report("on_val_loss_report", metrics_row(  # (records.py: each key's meaning)
            step=self.steps_done, outer_step=self.strategy.outer_steps_done(self.steps_done),
            tokens=self.tokens(), examples=self.examples(),
            eval_loss=global_loss, eval_loss_workers=self._by_slot(worker_losses),
            train_loss=None if train_losses is None else mean_of_numbers(train_losses),
            train_loss_workers=self._by_slot(train_losses),
            members=self.pacing.member_count(self.steps_done),
            tokens_per_shard=self.tokens_per_shard(), inner_steps_lost=self.pacing.lost_steps(self.steps_done),
            membership_changes=[c.row() for c in self.pacing.changes_between(self._last_evaluation(), self.steps_done)],
            bytes_sent_per_worker=ledger.bytes_sent, peak_exchange_bytes=ledger.peak_bytes,
            compute_s=self.compute_s, comm_s=ledger.comm_s, modelled_time_s=modelled, sync_wait_s=self.comm.wait_s,
            utilisation=self.compute_s * (1 - idle) / modelled if modelled else 1.0,
            idle_fraction=idle, worker_speeds=self.pacing.worker_speeds(),
            measured_utilisation=spent["busy_s"] / (spent["busy_s"] + spent["link_s"] + spent["straggler_s"])
            if spent["busy_s"] else 1.0, **spent, flops_per_token=self.flops_per_token, peak_gflops=self.peak_gflops,
            wall_s=time.time() - self.wall_start, time=time.time(),
            peak_memory_bytes=int(self.peak_memory * 1e6), workers_per_process=self.comm.n_local,
            strategy=c.strategy, workers=c.workers, sync_every=self.strategy.sync_every, link=ledger.link.name,
            strategy_options=self.strategy.options(), objective=c.objective, **objective,
        ))

    def _job_time_spent(self) -> dict:
        """Where the processes' time went (the mean over them: "busy_s" their compute) and the job's MFU
        (the mean of theirs, each against its own peak: on a machine the processes share, the share
        of the cores it may use)."""
        spent = self.time_spent()
        mine = [spent["compute_s"], spent["link_s"], spent["straggler_s"], math.nan if spent["mfu"] is None else spent["mfu"]]
        every = np.array(self.comm.gather_metric(mx.array([mine] * self.comm.n_local)))
        busy, link, straggler, mfus = every.mean(axis=0).tolist()
        return {"busy_s": busy, "link_s": link, "straggler_s": straggler, "mfu": None if math.isnan(mfus) else mfus}

    def _last_evaluation(self) -> int:
        """The step of the evaluation before this step's."""
        return (self.steps_done - 1) // self.eval_every * self.eval_every

    def _peak_memory(self) -> float:
        """MLX's peak memory (MB) of every process (each hosts n_local workers): the largest one."""
        return max(self.comm.gather_metric(mx.full((self.comm.n_local,), mx.get_peak_memory() / 1e6)))

    def summary(self) -> dict:
        rows = MetricsLog.read(self.run_dir / "metrics.jsonl") if self.reporter else []
        last = rows[-1] if rows else {}
        # the run's peak: the rows from before a resume hold the peaks of the processes before
        peak = max([int(self.peak_memory * 1e6)] + [r.get("peak_memory_bytes", 0) for r in rows])
        return run_summary(
            run_dir=str(self.run_dir), strategy=self.config.strategy, workers=self.config.workers,
            steps=self.steps_done, parameters=self.n_params, final_eval_loss=last.get("eval_loss"),
            tokens=last.get("tokens"), examples=last.get("examples"), tokens_per_shard=self.tokens_per_shard(),
            examples_per_shard=self.examples_per_shard(), inner_steps_lost=self.pacing.lost_steps(self.steps_done),
            bytes_sent_per_worker=self.ledger.bytes_sent, peak_exchange_bytes=self.ledger.peak_bytes,
            compute_s=self.compute_s, modelled_comm_s=self.ledger.comm_s, utilisation=last.get("utilisation"),
            link=self.ledger.link.describe(),
            **{k: last.get(k) for k in ("measured_utilisation", "busy_s", "link_s", "straggler_s", "mfu",
                                        "flops_per_token", "peak_gflops")},
            peak_memory_bytes=peak, workers_per_process=self.comm.n_local,
            kernels=kernel_paths().describe(self.config.precision), inner_step=self.workers.describe(),
            **{k: last.get(k) for k in self.objective.summary_keys})

    # ------------------------------------------------------------ checkpoints
    def state(self) -> tuple:
        """What a checkpoint keeps of the run, each part's state gathered here: (arrays, meta) in
        checkpoint.py's schema (run_folder.META)."""
        spent = self.time_spent()
        arrays = {"workers": {"params": self.workers.params, "inner": self.workers.optimizer.state},
                  "strategy": self.strategy.state()}
        meta = {"config": self.config.to_dict(), "cursors": [s.state() for s in self.samplers],
                "compute_s": self.compute_s, "worker_speeds": self.pacing.worker_speeds(),
                "exchanges": self.ledger.state(), "waits_s": {k: spent[k] for k in self.waited_s},
                "model_preset": self.spec.params if self.spec else None, "vocab_size": self.data.vocab_size,
                "objective": self.objective.state()}
        if self.job.ring_slots:
            meta["membership"] = {"ring_slots": self.job.ring_slots,
                                  "history": self.job.membership or self.config.membership}
        return arrays, meta

    def load_state(self, arrays: dict, meta: dict):
        self.steps_done, self.compute_s = meta["step"], meta["compute_s"]
        # In the order of the trees they replace: a checkpoint reads back with its keys sorted, and
        # whatever walks a tree in order (SPARTA's flat indices) must find the same parameters.
        self.workers.params = in_order_of(self.workers.params, arrays["workers"]["params"])
        self.workers.optimizer.state = in_order_of(self.workers.optimizer.state, arrays["workers"]["inner"])
        self.strategy.load_state(arrays.get("strategy", {}))
        for sampler, cursor in zip(self.samplers, meta["cursors"]):
            sampler.load_state(cursor)
        self.pacing.resume_with(meta["worker_speeds"])
        self.ledger.load_state(meta["exchanges"])
        self.waited_s = meta.get("waits_s", self.waited_s)
        self.objective.load_state(meta.get("objective") or {})

    def save_checkpoint(self):
        # Weights not yet exchanged (other fragments', or with an exchange in flight) are checked here:
        # a checkpoint never keeps a NaN that a resumed run would train on.
        self.comm.check_finite(self.workers.params, "its weights")
        arrays, meta = self.state()
        checkpoint.save(self.checkpoint_dir, self.steps_done, arrays, meta)  # empties `arrays` as it writes
        if self.reporter and self.config.fine_tune_type in ADAPTER_TYPES:  # the global adapters, for mlx-lm
            save_adapters(self.run_dir / ADAPTERS, self.global_params(),
                          {**adapter_config(self.config), "model": self.config.model})

    def _restore(self):
        self.load_state(*checkpoint.load(self.checkpoint_dir, self.job.resume_step, log=self.log))
        self.log(f"resumed {self.run_dir} at step {self.steps_done}")
