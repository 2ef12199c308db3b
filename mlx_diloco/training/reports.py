"""What a run reports, built from its parts (records.py declares every key): a train report after each
step (records.PROGRESS), a metrics row at each evaluation (ROW) and the summary at the end (SUMMARY),
with the counts they share: the examples and tokens each shard has given, the train losses since the
last evaluation, each slot's values on an elastic cluster's ring."""

import math
import time

import mlx.core as mx
import numpy as np

from ..models.kernels import paths as kernel_paths
from ..records import PROGRESS, ROW, metrics_row, run_summary


def mean_of_numbers(values: list) -> float:
    """The mean of the values that are not NaN (a worker that took no step has a NaN loss); NaN if none."""
    numbers = [v for v in values if not math.isnan(v)]
    return sum(numbers) / len(numbers) if numbers else float("nan")


class Reports:
    def __init__(self, config, comm, job, data, strategy, pacing, ledger, clock):
        self.config, self.comm, self.job, self.data = config, comm, job, data
        self.strategy, self.pacing, self.ledger, self.clock = strategy, pacing, ledger, clock
        self._clear_train_losses()

    # ------------------------------------------------------------ every step
    def _clear_train_losses(self):
        """Each local worker's (sum, count) of train losses, before any (a worker with none: NaN)."""
        self._loss_sum, self._loss_count = mx.zeros((self.comm.n_local,)), mx.zeros((self.comm.n_local,))

    def train_report(self, tick) -> dict:
        """After a tick at which this process's workers trained: its train report (PROGRESS), its losses
        counted toward the next row's."""
        c, n = self.config, self.comm.n_local
        taken = mx.ones((n,)) if tick.members is None else mx.array(tick.members, mx.float32)
        self._loss_sum = self._loss_sum + mx.where(taken > 0, tick.losses, 0)
        self._loss_count = self._loss_count + taken
        losses = tick.losses if tick.members is None else tick.losses[mx.array(np.flatnonzero(tick.members))]
        tokens = c.batch_size * (self.data.tokens_per_example() or 1) * losses.size  # (or examples)
        job = self.pacing.member_count(tick.step)
        self.clock.tokens += tokens
        trained = self.pacing.active(tick.step) or [True] * n
        return PROGRESS.check({
            PROGRESS.step: tick.step, PROGRESS.steps: c.steps, PROGRESS.loss: float(losses.mean().item()),
            PROGRESS.worker_losses: [loss if t else None for loss, t in zip(tick.losses.tolist(), trained)],
            PROGRESS.tokens_per_s: tokens / tick.seconds, PROGRESS.job_tokens_per_s: tokens * job / losses.size / tick.seconds,
            PROGRESS.sync_s: self.comm.wait_s, PROGRESS.bytes_sent: self.ledger.bytes_sent, **self.clock.spent(),
            PROGRESS.memory_bytes: mx.get_active_memory(), PROGRESS.memory_limit_bytes: int(c.memory_limit * 1e9) or None})

    def take_train_losses(self) -> mx.array:
        """Each local worker's mean train loss since the last evaluation (then counted afresh)."""
        mean = self._loss_sum / self._loss_count
        self._clear_train_losses()
        return mean

    # ------------------------------------------------------------ what the shards gave
    def examples_per_shard(self) -> list:
        """Examples each worker's shard has given so far."""
        return [n * self.config.batch_size for n in self.pacing.steps_taken(self.clock.steps)]

    def tokens_per_shard(self):
        per_example = self.data.tokens_per_example()
        return None if per_example is None else [n * per_example for n in self.examples_per_shard()]

    def by_slot(self, values: list) -> list:
        """One value per slot, NaN where no member is, from one per ring worker (an elastic cluster's)."""
        if not self.job.ring_slots or values is None:
            return values
        out = [float("nan")] * self.config.workers
        for slot, value in zip(self.job.ring_slots, values):
            out[slot] = value
        return out

    # ------------------------------------------------------------ every evaluation
    def row(self, global_loss: float, worker_losses: list, train_losses, spent: dict, peak_memory_mb: float,
            since: int, objective: dict) -> dict:
        """The evaluation's metrics row (ROW): `worker_losses` and `train_losses`, every worker's (gathered;
        None before any step); `spent`, the clock's job_spent; `since`, the step of the evaluation before."""
        c, ledger, clock, steps = self.config, self.ledger, self.clock, self.clock.steps
        modelled = clock.compute_s + ledger.comm_s
        idle = self.pacing.idle_fraction()
        per_example, examples = self.data.tokens_per_example(), sum(self.examples_per_shard())
        busy = spent[ROW.busy_s]
        return metrics_row(  # (records.py: each key's meaning)
            step=steps, outer_step=self.strategy.outer_steps_done(steps),
            tokens=None if per_example is None else examples * per_example, examples=examples,
            eval_loss=global_loss, eval_loss_workers=self.by_slot(worker_losses),
            train_loss=None if train_losses is None else mean_of_numbers(train_losses),
            train_loss_workers=self.by_slot(train_losses), members=self.pacing.member_count(steps),
            tokens_per_shard=self.tokens_per_shard(), inner_steps_lost=self.pacing.lost_steps(steps),
            membership_changes=[change.row() for change in self.pacing.changes_between(since, steps)],
            bytes_sent_per_worker=ledger.bytes_sent, peak_exchange_bytes=ledger.peak_bytes,
            compute_s=clock.compute_s, comm_s=ledger.comm_s, modelled_time_s=modelled, sync_wait_s=self.comm.wait_s,
            utilisation=clock.compute_s * (1 - idle) / modelled if modelled else 1.0,
            idle_fraction=idle, worker_speeds=self.pacing.worker_speeds(),
            measured_utilisation=busy / (busy + spent[ROW.link_s] + spent[ROW.straggler_s]) if busy else 1.0,
            **spent, flops_per_token=clock.flops_per_token, peak_gflops=clock.peak_gflops, wall_s=clock.run_s(),
            time=time.time(), peak_memory_bytes=int(peak_memory_mb * 1e6), workers_per_process=self.comm.n_local,
            strategy=c.strategy, workers=c.workers, sync_every=self.strategy.sync_every, link=ledger.link.name,
            strategy_options=self.strategy.options(), objective=c.objective, **objective)

    # ------------------------------------------------------------ the end
    def summary(self, run_dir, rows: list, spent: dict, peak_memory_mb: float, parameters: int, inner_step: str,
                eval_examples: int, summary_keys=()) -> dict:
        """The run's summary (SUMMARY), from its metrics `rows` (the reporter's; [] elsewhere), the clock's
        job_spent, this run's peak memory, the held-out examples it evaluates, and the objective's `summary_keys`."""
        c, ledger, last = self.config, self.ledger, (rows or [{}])[-1]
        # the run's peak: the rows from before a resume hold the peaks of the processes before
        peak = max([int(peak_memory_mb * 1e6)] + [r.get(ROW.peak_memory_bytes, 0) for r in rows])
        same = (ROW.tokens, ROW.examples, ROW.utilisation, ROW.measured_utilisation, ROW.busy_s, ROW.link_s,
                ROW.straggler_s, ROW.mfu, ROW.flops_per_token, ROW.peak_gflops, *summary_keys)
        return run_summary(
            run_dir=str(run_dir), strategy=c.strategy, workers=c.workers, steps=self.clock.steps,
            parameters=parameters, final_eval_loss=last.get(ROW.eval_loss), **{k: last.get(k) for k in same},
            tokens_per_shard=self.tokens_per_shard(), examples_per_shard=self.examples_per_shard(),
            inner_steps_lost=self.pacing.lost_steps(self.clock.steps), bytes_sent_per_worker=ledger.bytes_sent,
            peak_exchange_bytes=ledger.peak_bytes, compute_s=self.clock.compute_s, modelled_comm_s=ledger.comm_s,
            link=ledger.link.describe(), wall_s=self.clock.run_s(), process_s=spent[ROW.process_s],
            time_s=spent[ROW.time_s], peak_memory_bytes=peak, workers_per_process=self.comm.n_local,
            eval_examples=eval_examples, kernels=kernel_paths().describe(c.precision), inner_step=inner_step)
