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
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..records import META, OPTIONAL_META, TIME, SavedArrays
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
from ..models.precision import to_bf16
from ..machine.memory import model_shape
from ..models.zoo import count_parameters
from ..objectives import make_objective
from ..objectives.base import Context
from ..objectives.rewards import RewardError
from ..run_folder import check_new_run_dir, latest_step
from ..machine.utilisation import flops_per_token, process_start
from ..worker_job import WorkerJob
from . import checkpoint
from .checkpoint import in_order_of
from .clock import RunClock
from .elastic import Elastic, StoppedForChange  # noqa: F401 (StoppedForChange: the worker catches it)
from .callbacks import Loggers, MetricsFile, ProgressBar, ProgressFile, StatusFile, check_loggers
from .metrics import MetricsLog
from .pacing import Pacing
from .reports import Reports
from .resolve import Parts, parts_from_config, resolve, saved_config
from .workers import Workers, check_loss


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
                 resume: bool = False, log=print, job: WorkerJob = None, parts: Parts = None, callbacks=None,
                 started_at: float = None):
        """`started_at`: when the run started in this process (a worker's: the process's start); default now."""
        started_at = started_at or time.time()
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
        # The notes, once the data is found (no line before an error); a job's workers were started by
        # a program that said them (sim's processes, the launcher).
        for note in resolved.notes if resolved and reporter and not job.config else ():
            log(note)
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
        held_out = self.data.eval_batches(config.batch_size, config.eval_sequences)
        self.eval_examples = sum(len(x) for x, _ in held_out)
        self.eval_batches = self.objective.eval_batches(self.workers, held_out)
        # What the objective may use of the run (objectives/base.py)
        self.context = Context(self.workers, comm, self.slots, reporter, self.global_params, self.eval_batches)
        if parts.loss is not None:  # a user's loss, tried on one batch before the run folder exists
            with memory_limit(config.memory_limit):
                check_loss(parts.loss, model, *self.eval_batches[0])
        self.ledger = ExchangeLedger(parse_link(config.link))
        # steps done, where the time went (clock.py)
        self.clock = RunClock(comm, started_at, flops_per_token=model_flops_per_token(model, self.spec, config))
        self._step_s = 0.0       # the last inner step's (a slow worker may wait out the first ticks)
        self.reports = Reports(config, comm, job, self.data, self.strategy, self.pacing, self.ledger, self.clock)
        self.n_params = count_parameters(model)
        if resume:
            self._restore()
        elif reporter:  # everything checked out: only now create the run folder
            self._create_run_folder()
        self.checkpoints = checkpoint.Writer()  # every write of the checkpoint folder, one at a time
        # An elastic cluster's ring (training/elastic.py): its workers brought to one round as it starts.
        self.elastic = Elastic(job, comm, self.pacing, self.strategy, self.workers, self.ledger, self.clock,
                               self.samplers, self.data_workers, config.batch_size, self.checkpoints,
                               self.checkpoint_dir, snapshot=self.state, memory_limit=config.memory_limit * 1e9,
                               log=log) \
            if job.ring_slots else None
        if self.elastic:
            self.elastic.start()
        self.callbacks = self._own_callbacks(resume) + list(callbacks or [])

    @classmethod
    def from_job(cls, job: WorkerJob, log=print) -> "Run":
        """The run of one worker of a cluster job or of sim's processes, as its job says; its rank
        and peers from MLX's environment (exchange/ring.py)."""
        comm = init_ring(job.collective_timeout, job.workers_per_process, job.backend)
        return cls(job.train_config, job.run_dir, comm, reporter=comm.local_workers[0] == 0,
                   resume=job.resume_step is not None, log=log, job=job, started_at=process_start())

    @property
    def steps_done(self) -> int:
        return self.clock.steps

    @steps_done.setter
    def steps_done(self, steps: int):
        self.clock.steps = steps

    @property
    def compute_s(self) -> float:
        """Measured compute time of one worker."""
        return self.clock.compute_s

    @compute_s.setter
    def compute_s(self, seconds: float):
        self.clock.compute_s = seconds

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
                    self.step()
                    if stop_after is not None and self.steps_done >= stop_after:
                        break
            except BaseException:
                self._report("on_train_stopped", {"step": self.steps_done})
                raise
            finally:
                with self.clock.part(TIME.save_s):
                    self.checkpoints.wait()  # a checkpoint in flight is on the disk when the run returns
            with self.clock.part(TIME.eval_s):
                self.peak_memory = self._peak_memory()  # the last global evaluation and checkpoint included
            summary = self.summary()
        self._report("on_train_end", summary)
        return summary

    def step(self, batch=None):
        """One tick of the job. `batch`: this process's (x, y), each with a leading axis over its
        workers (default: the next batch of each worker's shard)."""
        # An elastic cluster's worker may stop before the tick for a membership change, and holds its
        # state through a tick that meets its peers (training/elastic.py).
        elastic = self.elastic.tick(self._meets_peers(self.steps_done + 1)) if self.elastic else nullcontext()
        with self.clock.tick(), elastic:  # (clock.py: where the time goes)
            self.end_step(self.inner_step(batch))

    def inner_step(self, batch=None) -> Tick:
        """The first half of `step`: the inner step of the local workers that step at this tick
        (speeds.py), timed. Until `end_step`, they hold their local parameters."""
        if self.steps_done == 0:  # the starting point of every curve
            with self.clock.part(TIME.eval_s):
                self.evaluate(None, self._worker_losses(0))
        tick = Tick(self.steps_done + 1)
        tick.members = self.pacing.members(tick.step)
        x, y = batch or self.next_batch(tick.members)
        t0, wait0 = time.perf_counter(), self.comm.wait_s
        active = self.pacing.active(tick.step)
        if active is None or any(active):  # else this process's workers wait out the tick
            with self._stop_on_reward_error(tick.step), self.clock.part(TIME.generate_s):
                x, y = self.objective.batch(self.context, x, y, tick)  # (GRPO: rollouts, rewards)
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
        with self.clock.part(TIME.eval_s):
            worker_losses = self._worker_losses(t) if evaluate else None
        # The exchanges this tick starts reach the link at its end: the evaluation's and the checkpoint's
        # collectives would otherwise wait behind them (~0.2 s a checkpoint on the emulated cluster).
        with self.comm.exchanges_held():
            with self._stop_on_non_finite(t):
                self.workers.params = self.strategy.after_step(self.workers.take_params(), t, self.pacing.inputs_at(t))
            self.pacing.after_tick(t, self.compute_s)  # after the sync: the first round's, every worker stepped in it
            self._change_membership(t)
            # With overlap, only the time its overlapped inner steps do not hide counts.
            for row in self.ledger.record(t, self.comm.drain_records(), step_s=self.compute_s / t):
                self._report("on_sync_report", row)
            if tick.losses is not None:
                self._report("on_train_loss_report", self.reports.train_report(tick))
            if evaluate:
                with self.clock.part(TIME.eval_s):
                    self.evaluate(self.reports.take_train_losses(), worker_losses)
            if t % self.checkpoint_every == 0 or t == c.steps:
                if not evaluate:  # a checkpoint keeps no global model that diverged since the last evaluation
                    self._global_eval_loss([(x[:1], tree_map(lambda a: a[:1], y)) for x, y in self.eval_batches[:1]])
                with self._stop_on_non_finite(t), self.clock.part(TIME.save_s):
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

    # ------------------------------------------------------------ membership
    def _change_membership(self, step: int):
        """Report the workers that leave or join at `step`; joiners take the global model and a
        member's inner optimizer state (membership.py), and step from the next step."""
        changes = self.pacing.changes_between(step - 1, step)
        if self.reporter:
            for change in changes:
                self.log(change.describe())
        joining = [c.worker for c in changes if c.joined]
        if joining and not self.elastic:  # (on an elastic cluster a new ring makes the change)
            self.workers.admit([w in joining for w in self.comm.local_workers], self.global_params(),
                               self._inner_state_of(self.pacing.peer(step)))

    def _inner_state_of(self, worker: int) -> dict:
        """Worker `worker`'s per-replica inner optimizer state ({path: value}, no worker axis), wherever
        it is trained: every process takes part in the gather."""
        state = [(k, v) for k, v in tree_flatten(self.workers.optimizer.state) if v.ndim]  # not the shared step, lr
        buffer, shapes = flatten_workers(tree_unflatten(state))
        row = self.comm.all_gather({"state": buffer}, tag="a joiner's inner optimizer state")["state"][worker]
        return dict(tree_flatten(unflatten(row, shapes)))

    def _meets_peers(self, step: int) -> bool:
        """Whether `step` waits on the other workers: an exchange starts or lands, or an evaluation
        or a checkpoint gathers them."""
        return (self.pacing.exchanges_at(step) or step % self.eval_every == 0 or step == self.config.steps
                or step % self.checkpoint_every == 0)

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

    def _global_eval_loss(self, batches=None) -> float:
        """The global model's eval loss on `batches` (default: all the held-out ones; the reporter's to
        compute, 0 in another process). A NaN or inf one is divergence (an outer step too large leaves
        the weights finite and the logits not): every process stops before the model is checkpointed.
        Between evaluations a checkpoint asks it of one held-out sequence, on which such divergence shows
        as well (all of them, at every checkpoint, cost the emulated cluster 2% of its wall-clock)."""
        batches = self.eval_batches if batches is None else batches
        loss = self.workers.eval_params(self.global_params(), batches) if self.reporter else 0.0
        if not all(map(math.isfinite, self.comm.gather_metric(mx.full((self.comm.n_local,), loss)))):
            raise ConfigError(f"step {self.steps_done}: the global model's eval loss is not finite: training "
                              f"diverged, and the run stops before it is checkpointed ({self._kept()}); lower --lr or "
                              "--outer-lr, or raise --warmup")
        return loss

    def _kept(self) -> str:
        last = latest_step(self.checkpoint_dir)
        return f"its last checkpoint (step {last}) is intact" if last else "no checkpoint was written"

    # ------------------------------------------------------------ evaluation and metrics
    def global_params(self):
        return self.strategy.global_params(self.workers.params)

    def evaluate(self, train_losses, worker_losses):
        """Report a metrics row: the global model's eval loss, and each local model's (taken
        before the outer step, so the rows show how far the workers drifted apart). Every process
        evaluates its workers; the reporter gathers their losses and reports the row."""
        worker_losses = self.comm.gather_metric(worker_losses)
        train_losses = None if train_losses is None else self.comm.gather_metric(train_losses)
        self.peak_memory = self._peak_memory()
        spent = self.clock.job_spent()
        objective = self.objective.report(self.context)  # every process: it gathers the workers' values
        global_loss = self._global_eval_loss()
        if self.reporter:
            self._report("on_val_loss_report", self.reports.row(
                global_loss, worker_losses, train_losses, spent, self.peak_memory, self._last_evaluation(), objective))

    def _last_evaluation(self) -> int:
        """The step of the evaluation before this step's."""
        return (self.steps_done - 1) // self.eval_every * self.eval_every

    def _peak_memory(self) -> float:
        """MLX's peak memory (MB) of every process (each hosts n_local workers): the largest one."""
        return max(self.comm.gather_metric(mx.full((self.comm.n_local,), mx.get_peak_memory() / 1e6)))

    def summary(self) -> dict:
        """The run's summary (records.SUMMARY). Every process takes part (its time split gathered)."""
        spent = self.clock.job_spent()
        rows = MetricsLog.read(self.run_dir / "metrics.jsonl") if self.reporter else []
        return self.reports.summary(self.run_dir, rows, spent, self.peak_memory, self.n_params, self.workers.describe(),
                                    self.eval_examples, self.objective.summary_keys)

    # ------------------------------------------------------------ checkpoints
    def state(self) -> tuple:
        """What a checkpoint keeps of the run, each part's state gathered here: (arrays, meta) in
        checkpoint.py's schema (records.CHECKPOINT, records.META)."""
        arrays = SavedArrays(self.workers.params, self.workers.optimizer.state, self.strategy.state()).arrays()
        meta = {META.config: self.config.to_dict(), META.cursors: [s.state() for s in self.samplers],
                META.compute_s: self.compute_s, META.worker_speeds: self.pacing.worker_speeds(),
                META.exchanges: self.ledger.state(), **self.clock.state(),
                META.model_preset: self.spec.params if self.spec else None, META.vocab_size: self.data.vocab_size,
                OPTIONAL_META.objective: self.objective.state()}
        if self.job.ring_slots:
            meta[OPTIONAL_META.membership] = {"ring_slots": self.job.ring_slots,
                                              "history": self.job.membership or self.config.membership}
        return arrays, meta

    def load_state(self, arrays: dict, meta: dict):
        self.steps_done, self.compute_s = meta[META.step], meta[META.compute_s]
        # In the order of the trees they replace: a checkpoint reads back with its keys sorted, and
        # whatever walks a tree in order (SPARTA's flat indices) must find the same parameters.
        saved = SavedArrays.of(arrays)
        self.workers.params = in_order_of(self.workers.params, saved.params)
        self.workers.optimizer.state = in_order_of(self.workers.optimizer.state, saved.inner)
        self.strategy.load_state(saved.strategy)
        for sampler, cursor in zip(self.samplers, meta[META.cursors]):
            sampler.load_state(cursor)
        self.pacing.resume_with(meta[META.worker_speeds])
        self.ledger.load_state(meta[META.exchanges])
        self.clock.load_state(meta)
        self.objective.load_state(meta.get(OPTIONAL_META.objective) or {})

    def save_checkpoint(self):
        # Weights not yet exchanged (other fragments', or with an exchange in flight) are checked here:
        # a checkpoint never keeps a NaN that a resumed run would train on.
        self.comm.check_finite(self.workers.params, "its weights")
        arrays, meta = self.state()
        # Written while training goes on (checkpoint.Writer), but the last one and where the memory
        # cannot hold the state beside the next (or it waits in files: offload-outer)
        background = (self.steps_done < self.config.steps and not self.strategy.offloads_outer
                      and checkpoint.fits_beside(arrays, self.config.memory_limit * 1e9))
        with self.elastic.lock if self.elastic else nullcontext():  # (one writer: elastic.py's watcher)
            self.checkpoints.save(self.checkpoint_dir, self.steps_done, arrays, meta, background=background)
        if self.reporter and self.config.fine_tune_type in ADAPTER_TYPES:  # the global adapters, for mlx-lm
            save_adapters(self.run_dir / ADAPTERS, self.global_params(),
                          {**adapter_config(self.config), "model": self.config.model})

    def _restore(self):
        self.load_state(*checkpoint.load(self.checkpoint_dir, self.job.resume_step, log=self.log))
        self.log(f"resumed {self.run_dir} at step {self.steps_done}")
