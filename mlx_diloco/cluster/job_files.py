"""What the launching machine's run folder shows of a running cluster job (MLX-free): rank 0's metrics
and exchanges, mirrored as they come (`Mirror`: `mlx-diloco plot` compares cluster and sim runs),
and RUN/status.json, each worker's machine, state, step rate, tokens/s and memory against what its
machine offers (`JobStatus`: the dashboard's workers, run_status.py)."""

import json

from .. import run_status
from ..records import PROGRESS, ROW, STATUS
from ..schedules.schedule import SyncSchedule
from ..training.metrics import MetricsLog
from ..worker_job import STOPPED_FOR_CHANGE


class Mirror:
    """RUN/metrics.jsonl and RUN/exchanges.jsonl: rank 0's lines, appended as its agent passes them on."""

    def __init__(self, run_dir):
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.exchanges = MetricsLog(run_dir / "exchanges.jsonl")

    def add(self, metrics: list, exchanges: list):
        self._append(metrics, self.metrics)
        self._append(exchanges, self.exchanges)

    @staticmethod
    def _append(lines: list, log: MetricsLog):
        """Append rank 0's lines to this folder's copy that it lacks: those of later steps than its last,
        and of that step those not in it (one step's exchanges may come in two polls). After a restart the
        lines come again from the start of rank 0's file."""
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

    def truncate_after(self, step: int):
        """The rows after `step` are redone by the restarted ring: drop them from the copies."""
        self.metrics.truncate_after(step)
        self.exchanges.truncate_after(step)

    def rows(self) -> list:
        return MetricsLog.read(self.metrics.path) if self.metrics.path.exists() else []


class JobStatus:
    """RUN/status.json from the members' polls. `grid`: every how many steps the job's workers sync
    (0: every step, or when they report), by which a worker blocked in a collective shows as syncing."""

    def __init__(self, run_dir, steps: int, grid: int):
        self.writer = run_status.StatusWriter(run_dir, "launch")
        self.steps, self.grid = steps, SyncSchedule(grid)
        self.step_rate, self.shown = run_status.StepRate(), {}
        self.offered = {}  # each slot's memory its machine offers (the last start's hellos)

    def show(self, members: list, spares: list, states: dict, restart_s: float):
        """One poll of the members (`states`: their answers, by slot; a member missing did not answer)."""
        self._write([self._row(m, states.get(m.worker_id), restart_s) for m in members], spares)

    def show_all(self, members: list, spares: list, state: str, lost=()):
        """While the ring is down (a restart, a change, a wait for lost machines): every member in
        `state`, those of `lost` lost, each with what it reported last."""
        rows = [{**self.shown.get(m.worker_id, {STATUS.worker: m.worker_id, STATUS.host: m.host or m.address}),
                 STATUS.state: "lost" if m.worker_id in lost else state} for m in members]
        self._write(rows, spares, force=True)

    def _write(self, rows: list, spares: list, force: bool = False):
        """The members' rows (in ring order, with their ranks), then the machines out of the ring: lost,
        or waiting to join."""
        rows = [{**row, STATUS.rank: rank} for rank, row in enumerate(rows)]
        out = [{STATUS.worker: m.worker_id if m.worker_id >= 0 else None, STATUS.host: m.host or m.address,
                STATUS.state: "lost" if m.lost else "waiting"} for m in spares]
        step = min((r[STATUS.step] for r in rows if r.get(STATUS.step) is not None), default=0)
        self.writer.write(step, self.steps, rows + out, force=force)

    def _row(self, m, status, restart_s: float) -> dict:
        """A member's row from its poll (None: its agent did not answer), over what it reported before."""
        row = {**self.shown.get(m.worker_id, {}), STATUS.worker: m.worker_id, STATUS.host: m.host or m.address,
               STATUS.memory_limit_bytes: self.offered.get(m.worker_id), STATUS.restart_s: restart_s}
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
            grid = self.grid
            return "syncing" if not grid.every or grid.syncs(progress[PROGRESS.step] + 1) else "waiting"
        return "training"
