"""The communication interface that every strategy is written against.

Arrays exchanged between workers carry a leading *worker axis* over the workers that this
process hosts: all N of them in the simulator, one on a real cluster. With that convention an
all-reduce is "sum over the worker axis of every worker in the job" and an all-gather is
"concatenate the worker axes of every worker", whichever transport runs underneath.

A transport implements two primitives, `_sum_workers` and `_gather_workers`; this base class
adds what every transport shares: dtype handling, averaging, asynchronous starts (so Streaming
DiLoCo can overlap an exchange with compute), and accounting of the bytes each worker sends.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def tree_nbytes(tree) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree))


def stack_copies(tree, n: int):
    """The same values for n workers, on a new leading axis."""
    return tree_map(lambda x: mx.broadcast_to(x[None], (n, *x.shape)), tree)


@dataclass
class CollectiveRecord:
    op: str               # "all_reduce" or "all_gather"
    payload_bytes: int    # one worker's contribution
    sent_bytes: int       # what one worker sends on a ring


class Pending:
    """An exchange that has been started; `result()` waits for it."""

    def __init__(self, tree, comm: "Communicator"):
        self._tree, self._comm = tree, comm
        with comm._blocked():  # on the CPU stream, starting an exchange can block too
            mx.async_eval(self._tree)

    def result(self):
        with self._comm._blocked():
            mx.eval(self._tree)
        return self._tree


@dataclass
class Communicator:
    num_workers: int
    local_workers: list           # job-wide indices of the replicas on the leading axis
    records: list = field(default_factory=list)
    wait_s: float = 0.0           # time spent waiting for exchanges to finish

    # ---- what a transport implements
    def _sum_workers(self, x: mx.array) -> mx.array:
        """(n_local, ...) -> (...): the sum over every worker in the job."""
        raise NotImplementedError

    def _gather_workers(self, x: mx.array) -> mx.array:
        """(n_local, ...) -> (num_workers, ...): every worker's slice, in worker order."""
        raise NotImplementedError

    @contextmanager
    def _blocked(self):
        """Around every wait on an exchange: counts the time (a transport may add a watchdog)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - t0

    # ---- what strategies call
    @property
    def n_local(self) -> int:
        return len(self.local_workers)

    def all_mean(self, tree, dtype: str = "float32"):
        """Mean over all workers of a tree of (n_local, ...) arrays, exchanged in `dtype`;
        returned in float32 without the worker axis."""
        return self.start_all_mean(tree, dtype).result()

    def start_all_mean(self, tree, dtype: str = "float32") -> Pending:
        wire = tree_map(lambda x: x.astype(DTYPES[dtype]), tree)
        mx.eval(wire)  # inputs are ready before the exchange starts: waits then measure only the exchange
        self._record("all_reduce", wire)
        M = self.num_workers
        return Pending(tree_map(lambda x: self._sum_workers(x).astype(mx.float32) / M, wire), self)

    def all_gather(self, tree):
        """Every worker's values (for things that cannot be summed, e.g. quantized blocks)."""
        self._record("all_gather", tree)
        mx.eval(tree)
        out = tree_map(self._gather_workers, tree)
        with self._blocked():
            mx.eval(out)
        return out

    def broadcast_local(self, tree):
        """Give every local worker the same values: (...) -> (n_local, ...)."""
        return stack_copies(tree, self.n_local)

    # ---- accounting
    def _record(self, op, wire_tree):
        payload = tree_nbytes(wire_tree) // self.n_local
        M = self.num_workers
        # Ring algorithms: all-reduce sends 2(M-1)/M of the payload, all-gather (M-1) payloads.
        sent = int(2 * (M - 1) / M * payload) if op == "all_reduce" else (M - 1) * payload
        self.records.append(CollectiveRecord(op, payload, sent))

    def drain_records(self) -> list:
        records, self.records = self.records, []
        return records


class SimCommunicator(Communicator):
    """All workers live in this process, stacked on the leading axis."""

    def __init__(self, num_workers: int):
        super().__init__(num_workers, list(range(num_workers)))

    def _sum_workers(self, x):
        return x.sum(axis=0)

    def _gather_workers(self, x):
        return x
