"""The training run: the same loop drives the simulator and a real cluster worker.

Which workers this process trains, and how they talk, come from the communicator; everything
else (data shards, inner steps, strategy hooks, evaluation, metrics, checkpoints, the network
time model) lives here once.
"""

import json
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from ..atomic import atomic_write_text
from ..config import ConfigError, TrainConfig
from ..data.datasets import (BatchStream, ShardSampler, oversized_batch)
from ..exchange.comm import Communicator, NonFiniteValues
from ..exchange.network import exchange_time, parse_link
from ..models.checkpointing import checkpoint_blocks
from ..models.precision import to_bf16
from ..models.zoo import count_parameters
from ..run_folder import check_new_run_dir, latest_step
from .resolve import Parts, parts_from_config, resolve, saved_config
from . import checkpoint
from .metrics import MetricsLog, human_bytes
from ..speeds import Speeds
from .workers import Workers, check_loss


@dataclass
class Placement:
    """Where a cluster worker's pieces are, when they differ from the simulator's defaults."""
    shard_dir: str = None          # a shard shipped by the launcher (default: read config.data)
    data_worker: int = None        # which shard this process trains (default: its rank)
    num_shards: int = None         # how many shards the data was cut into (default: config.workers)
    checkpoint_dir: str = None     # default: the run folder (rank 0) or run_dir/worker-RANK
    progress_path: str = None      # a small JSON file rewritten every step, for the agent to report
    resume_step: int = None        # resume from this checkpoint rather than the newest


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


class Run:
    """One training run in this process, over the workers `comm` says it hosts."""

    def __init__(self, config: TrainConfig, run_dir, comm: Communicator, reporter: bool = True,
                 resume: bool = False, log=print, place: Placement = None, parts: Parts = None):
        self.run_dir, self.comm, self.reporter, self.log = Path(run_dir), comm, reporter, log
        self.place = place = place or Placement()
        # Each process checkpoints the workers it hosts; rank 0 (or the simulator) in the run folder.
        self.checkpoint_dir = Path(place.checkpoint_dir or (
            self.run_dir if reporter else self.run_dir / f"worker-{comm.local_workers[0]}"))
        if resume:
            config = config or saved_config(self.checkpoint_dir)
        elif reporter:
            check_new_run_dir(self.run_dir)
        resolved = resolve(config) if parts is None else None
        self.config = config = resolved.config if resolved else config
        if comm.num_workers != config.workers:
            raise ConfigError(f"the job has {comm.num_workers} workers but the config says {config.workers}")
        parts = parts or parts_from_config(resolved, log, place.shard_dir)
        self.spec, self.data, model = parts.spec, parts.data, parts.model
        if config.precision == "bf16":
            to_bf16(model)
        if config.grad_checkpoint and not checkpoint_blocks(model):
            raise ConfigError("grad-checkpoint needs a model of transformer blocks (paths h.N or layers.N); "
                              "drop --grad-checkpoint")
        self.link = parse_link(config.link)
        self.strategy = parts.strategy.bind(comm, config.steps)
        self.speeds = Speeds.of(config)
        # Time-paced without given speeds (a real cluster): measured over the first round.
        self.measure_speeds = config.speed_policy == "time" and self.speeds is None and config.workers > 1
        config.check_strategy(self.strategy)  # e.g. speed-policy time with a strategy it fits
        if self.speeds and self.speeds.policy == "time":
            self._pace_by_time()
        self.strategy.setup(model.trainable_parameters())
        # Evaluations every outer step of a periodic strategy (else every 50 steps); checkpoints too.
        period = self.strategy.sync_every
        self.eval_every = config.eval_every or period or 50
        self.checkpoint_every = period or self.eval_every
        # Checkpointed blocks are for memory: replicas one after another, so that passes can go
        # block by block (models/checkpointing.py), which vmap does not allow.
        vectorize = False if config.grad_checkpoint else parts.vectorize
        self.workers = Workers(model, comm.n_local, config, self.strategy.inner_optimizer(config),
                               clip=self.strategy.clip_gradients, vectorize=vectorize, loss=parts.loss, log=log)
        self.data_workers = comm.local_workers if place.data_worker is None else [place.data_worker]
        if isinstance(self.data.train, BatchStream):  # batches given one by one: the stream is the cursor
            self.samplers = [self.data.train]
        else:
            self.samplers = [ShardSampler(len(self.data.train), w, place.num_shards or config.workers, config.seed,
                                          is_shard=self.data.is_shard) for w in self.data_workers]
        if reporter and not resume and (note := oversized_batch(config.batch_size, self.samplers)):
            log(note)
        self.eval_batches = self.data.eval_batches(config.batch_size, config.eval_batches)
        if parts.loss is not None:  # a user's loss, tried on one batch before the run folder exists
            with memory_limit(config.memory_limit):
                check_loss(parts.loss, model, *self.eval_batches[0])
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.exchanges = MetricsLog(self.run_dir / "exchanges.jsonl")
        self.step = 0
        self.compute_s = 0.0     # measured compute time of one worker
        self.comm_s = 0.0        # modelled exchange time on the configured link
        self.bytes_sent = 0      # by one worker
        self.peak_exchange_bytes = 0  # the largest single exchange (bytes one worker sends)
        self.exchange_log = []   # (hops, bytes sent, overlap steps) of every exchange: its time on any link
        self.wall_start = time.time()
        self.n_params = count_parameters(model)
        if resume:
            self._restore()
        elif reporter:  # everything checked out: only now create the run folder
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
            if self.data.tokenizer_dir:
                shutil.copytree(self.data.tokenizer_dir, self.run_dir / "tokenizer", dirs_exist_ok=True)

    def _pace_by_time(self):
        """Workers take the steps that fit a round (speeds.py): weigh each worker's
        pseudo-gradient by the tokens it processed."""
        s, H = self.strategy, self.strategy.sync_every
        weights = self.speeds.sync_weights(H)  # every worker steps in a round: config.check_strategy
        s.sync_weights = [weights[w] for w in self.comm.local_workers]

    def _measure_speeds(self):
        """Every worker's speed from its mean step time over the first round (all workers
        stepped at every tick so far), the fastest 1; from now on each takes the steps that fit."""
        times = self.comm.gather_metric(mx.full((self.comm.n_local,), self.compute_s / self.step))
        H = self.strategy.sync_every
        # In steps of 0.05 (machines within a few percent count as equal), and at least one step a round.
        speeds = tuple(max(round(20 * min(times) / t) / 20, 1 / H) for t in times)
        self.speeds, self.measure_speeds = Speeds(speeds, "time"), False
        self._pace_by_time()
        self.log(f"measured worker speeds: {', '.join(f'{s:g}' for s in speeds)}; each takes the steps that fit a round")

    def examples(self) -> int:
        """Examples (sequences, images, rows) the workers have trained on so far."""
        c = self.config
        steps = self.speeds.steps_taken(self.step) if self.speeds else [self.step] * c.workers
        return sum(steps) * c.batch_size

    def tokens(self):
        """Tokens the workers have trained on so far; None when the examples are not tokens."""
        per_example = self.data.tokens_per_example()
        return None if per_example is None else self.examples() * per_example

    # ------------------------------------------------------------ the loop
    def next_batch(self):
        if isinstance(self.data.train, BatchStream):
            xs, ys = zip(*self.data.train.next(self.data_workers, self.config.workers))
        else:
            xs, ys = zip(*(self.data.train.get(s.next_indices(self.config.batch_size)) for s in self.samplers))
        return mx.array(np.stack(xs)), mx.array(np.stack(ys))

    def train(self, stop_after: int = None) -> dict:
        """Train to the configured step count (or stop after `stop_after` steps, for tests)."""
        with memory_limit(self.config.memory_limit):
            return self._train(stop_after)

    def _train(self, stop_after: int = None) -> dict:
        c = self.config
        if self.step == 0:
            self.evaluate(None, self.workers.eval_each(self.eval_batches))
        bar = tqdm(total=c.steps, initial=self.step, disable=not self.reporter, file=sys.stderr,
                   desc=f"{c.strategy} x{c.workers}", dynamic_ncols=True)
        loss_sum, loss_count = 0, 0
        tokens_per_step = c.batch_size * (self.data.tokens_per_example() or 1) * self.comm.n_local  # or examples
        step_s = dt = 0.0  # (until this process's workers take a step: a slow one may wait at first)
        while self.step < c.steps:
            x, y = self.next_batch()
            t0, wait0 = time.perf_counter(), self.comm.wait_s
            active = self._active(self.step + 1)
            stepped = active is None or any(active)  # else this process's workers wait out the tick
            if stepped:
                with self._stop_on_non_finite(self.step + 1):
                    losses = self.workers.step(x, y, self.strategy, self.step + 1, active)
                loss_sum, loss_count = loss_sum + losses, loss_count + 1
                dt = time.perf_counter() - t0
                step_s = (dt - (self.comm.wait_s - wait0)) / self.comm.n_local  # DDP syncs inside the step
            self.step += 1
            step_s = c.step_time or step_s
            self.compute_s += self.speeds.tick_seconds(step_s) if self.speeds else step_s
            if self.measure_speeds and self.step == self.strategy.sync_every:
                self._measure_speeds()
            evaluate = self.step % self.eval_every == 0 or self.step == c.steps
            # The local models are evaluated before the outer step replaces them with the global one.
            worker_losses = self.workers.eval_each(self.eval_batches) if evaluate else None
            with self._stop_on_non_finite(self.step):
                self.workers.params = self.strategy.after_step(self.workers.take_params(), self.step)
            self._account_exchanges()
            if self.place.progress_path and stepped:
                self._write_progress(losses, tokens_per_step / dt)
            bar.update(1)
            if stepped:
                bar.set_postfix(loss=f"{losses.mean().item():.3f}",  # tokens/s of the whole job
                                tok_s=f"{tokens_per_step * c.workers / self.comm.n_local / dt:,.0f}",
                                sent=human_bytes(self.bytes_sent))
            if evaluate:
                self.evaluate(loss_sum / loss_count if loss_count else mx.full((self.comm.n_local,), float("nan")),
                              worker_losses)
                loss_sum, loss_count = 0, 0
            if self.step % self.checkpoint_every == 0 or self.step == c.steps:
                with self._stop_on_non_finite(self.step):
                    self.save_checkpoint()
            if stop_after is not None and self.step >= stop_after:
                break
        bar.close()
        self.peak_memory = self._peak_memory()  # the last global evaluation and checkpoint included
        return self.summary()

    @contextmanager
    def _stop_on_non_finite(self, step: int):
        """A worker that would send NaN or inf stops the run before its values reach any other
        worker or the global model (the communicator checks every exchange, and every worker
        learns of it at once); nothing is checkpointed after it, so the last checkpoint is intact."""
        try:
            yield
        except NonFiniteValues as e:
            last = latest_step(self.checkpoint_dir)
            kept = f"its last checkpoint (step {last}) is intact" if last else "no checkpoint was written"
            raise ConfigError(f"step {step}: {e}: training diverged, and the run stops before they reach the "
                              f"global model ({kept}); lower --lr or --outer-lr, or raise --warmup") from None

    def _active(self, tick: int):
        """Which local workers step at this tick; None when all do (speeds.py)."""
        if not self.speeds or self.speeds.policy == "fixed":
            return None
        active = self.speeds.active(tick)
        return [active[w] for w in self.comm.local_workers]

    def _write_progress(self, losses, tokens_per_s):
        atomic_write_text(self.place.progress_path, json.dumps({
            "step": self.step, "steps": self.config.steps, "loss": float(losses.mean().item()),
            "tokens_per_s": tokens_per_s, "sync_s": self.comm.wait_s, "bytes_sent": self.bytes_sent,
            "time": time.time()}), durable=False)

    def _account_exchanges(self):
        """Bytes and modelled time of the exchanges that finished; with overlap only what the
        overlapped inner steps do not hide counts. The reporter logs each one (exchanges.jsonl)."""
        step_s = self.compute_s / max(self.step, 1)
        rows = []
        for r in self.comm.drain_records():
            modelled = exchange_time(r.hops, r.sent_bytes, self.link)
            exposed = max(0.0, modelled - r.overlap_steps * step_s)
            self.bytes_sent += r.sent_bytes
            self.exchange_log.append((r.hops, r.sent_bytes, r.overlap_steps))
            self.peak_exchange_bytes = max(self.peak_exchange_bytes, r.sent_bytes)
            self.comm_s += exposed
            rows.append({"step": self.step, "what": r.tag, "codec": r.codec, "algorithm": r.algorithm,
                         "payload_bytes": r.payload_bytes, "sent_bytes": r.sent_bytes,
                         "overlap_steps": r.overlap_steps, "modelled_s": modelled, "exposed_s": exposed,
                         "blocked_s": r.blocked_s})
        if self.reporter and self.strategy.sync_every:  # not for strategies that exchange every step
            for row in rows:
                self.exchanges.write(row)

    # ------------------------------------------------------------ evaluation and metrics
    def global_params(self):
        return self.strategy.global_params(self.workers.params)

    def evaluate(self, train_losses, worker_losses):
        """Write a metrics row: the global model's eval loss, and each local model's (taken
        before the outer step, so the rows show how far the workers drifted apart). Every process
        evaluates its workers; the reporter gathers their losses and writes the row."""
        c = self.config
        worker_losses = self.comm.gather_metric(worker_losses)
        train_losses = None if train_losses is None else self.comm.gather_metric(train_losses)
        self.peak_memory = self._peak_memory()
        if not self.reporter:
            return
        global_loss = self.workers.eval_params(self.global_params(), self.eval_batches)
        modelled = self.compute_s + self.comm_s
        idle = sum(f := self.speeds.idle_fraction()) / len(f) if self.speeds else 0.0
        row = {
            "step": self.step, "outer_step": -(-self.step // period) if (period := self.strategy.sync_every) else None,
            "tokens": self.tokens(), "examples": self.examples(),
            "eval_loss": global_loss, "eval_loss_workers": worker_losses,
            "train_loss": None if train_losses is None else sum(train_losses) / len(train_losses),
            "train_loss_workers": train_losses,
            "bytes_sent_per_worker": self.bytes_sent, "peak_exchange_bytes": self.peak_exchange_bytes,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s, "modelled_time_s": modelled, "sync_wait_s": self.comm.wait_s,
            # modelled: the share of the time the workers compute (not waiting for the link, or
            # for slower workers: idle_fraction)
            "utilisation": self.compute_s * (1 - idle) / modelled if modelled else 1.0,
            "idle_fraction": idle, "worker_speeds": self.speeds and list(self.speeds.speeds),
            # on a real cluster: compute against the time actually spent waiting for exchanges
            "measured_utilisation": self.compute_s / (self.compute_s + self.comm.wait_s) if self.compute_s else 1.0,
            "wall_s": time.time() - self.wall_start,
            "peak_memory_bytes": int(self.peak_memory * 1e6), "workers_per_process": self.comm.n_local,
            "strategy": c.strategy, "workers": c.workers, "sync_every": period, "link": self.link.name,
            "strategy_options": self.strategy.options(),
        }
        self.metrics.write(row)

    def _peak_memory(self) -> float:
        """MLX's peak memory (MB) of every process (each hosts n_local workers): the largest one."""
        return max(self.comm.gather_metric(mx.full((self.comm.n_local,), mx.get_peak_memory() / 1e6)))

    def summary(self) -> dict:
        rows = MetricsLog.read(self.metrics.path) if self.reporter else []
        last = rows[-1] if rows else {}
        # the run's peak: the rows from before a resume hold the peaks of the processes before
        peak = max([int(self.peak_memory * 1e6)] + [r.get("peak_memory_bytes", 0) for r in rows])
        summary = {"run_dir": str(self.run_dir), "strategy": self.config.strategy,
                   "workers": self.config.workers, "steps": self.step, "parameters": self.n_params,
                   "final_eval_loss": last.get("eval_loss"), "tokens": last.get("tokens"),
                   "examples": last.get("examples"),
                   "bytes_sent_per_worker": self.bytes_sent, "peak_exchange_bytes": self.peak_exchange_bytes,
            "compute_s": self.compute_s,
                   "modelled_comm_s": self.comm_s, "utilisation": last.get("utilisation"),
                   "link": self.link.describe(), "peak_memory_bytes": peak,
                   "workers_per_process": self.comm.n_local}
        if self.reporter:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self):
        # Weights not yet exchanged (other fragments', or with an exchange in flight) are checked here:
        # a checkpoint never keeps a NaN that a resumed run would train on.
        self.comm.check_finite(self.workers.params, "its weights")
        # Flat, and no other reference to the tree: the checkpoint drops each array once written.
        flat = dict(tree_flatten({"workers": {"params": self.workers.params, "inner": self.workers.optimizer.state},
                                  "strategy": self.strategy.state()}))
        meta = {"config": self.config.to_dict(), "cursors": [s.state() for s in self.samplers],
                "compute_s": self.compute_s, "comm_s": self.comm_s, "bytes_sent": self.bytes_sent,
                "worker_speeds": self.speeds and list(self.speeds.speeds),
                "peak_exchange_bytes": self.peak_exchange_bytes, "exchange_log": self.exchange_log,
                "model_preset": self.spec.params if self.spec else None, "vocab_size": self.data.vocab_size}
        checkpoint.save(self.checkpoint_dir, self.step, flat, meta)

    def _restore(self):
        arrays, meta = checkpoint.load(self.checkpoint_dir, self.place.resume_step, log=self.log)
        self.step = meta["step"]
        self.workers.params = arrays["workers"]["params"]
        self.workers.optimizer.state = arrays["workers"]["inner"]
        self.strategy.load_state(arrays.get("strategy", {}))
        for sampler, cursor in zip(self.samplers, meta["cursors"]):
            sampler.load_state(cursor)
        self.compute_s, self.comm_s, self.bytes_sent = meta["compute_s"], meta["comm_s"], meta["bytes_sent"]
        if self.measure_speeds and meta.get("worker_speeds"):  # measured before the checkpoint
            self.speeds, self.measure_speeds = Speeds(tuple(meta["worker_speeds"]), "time"), False
            self._pace_by_time()
        self.peak_exchange_bytes = meta.get("peak_exchange_bytes", 0)
        self.exchange_log = [tuple(e) for e in meta.get("exchange_log", [])]
        self.metrics.truncate_after(self.step)
        self.exchanges.truncate_after(self.step)
        self.log(f"resumed {self.run_dir} at step {self.step}")
