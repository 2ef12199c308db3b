"""The real-cluster transport: one worker per process, MLX's ring backend between processes (or
jaccl, RDMA over Thunderbolt 5, where the launcher chose it: cluster/backend.py).

Collectives run on the CPU stream even on Metal, on inputs evaluated beforehand (comm.py does
that), so no GPU command buffer ever waits on a peer (REFERENCE.md: Metal's watchdog kills buffers that wait).

MLX's ring raises ~1 s after a peer dies but waits forever on a peer that stalls, and a group
cannot be re-formed in a process. So every wait on the ring runs under a watchdog: past the
collective timeout the process prints every thread's stack and exits, and the launcher restarts
the job from its last checkpoint. jaccl needs that watchdog more: a dead peer leaves its survivors
spinning at 100% CPU forever, with no error (ml-explore/mlx#4278), so its group goes through the
same RingCommunicator, every wait under the same watchdog. (An unplugged cable crashes jaccl with
SIGSEGV instead, mlx#4192: the agent reports the signal and the launcher recovers as for any death.)
"""

import json
import os
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from ..options import ConfigError
from .comm import Communicator, SimCommunicator
from .watchdog import watchdog


class RingCommunicator(Communicator):
    """Process r of K hosts workers r*n .. r*n + n - 1 (n = 1 on a cluster; more in `sim --processes`):
    sums add the local workers first, gathers concatenate the processes' slices in rank order, a
    shift passes each process's last worker to the next process, and a swap passes rows both ways
    between neighbouring processes."""

    def __init__(self, group, timeout_s: float, workers_per_process: int = 1):
        n, rank = workers_per_process, group.rank()
        super().__init__(group.size() * n, list(range(rank * n, rank * n + n)))
        self.group, self.timeout_s = group, timeout_s
        self.send_stream = mx.new_stream(mx.cpu)  # sends run beside the receives they pair with

    def _sum_workers(self, x):
        return mx.distributed.all_sum(x.sum(axis=0), group=self.group, stream=self.stream)

    def _gather_workers(self, x):
        return mx.distributed.all_gather(x, group=self.group, stream=self.stream)

    def _shift(self, x):
        rank, K = self.group.rank(), self.group.size()
        sent = mx.distributed.send(x[-1], (rank + 1) % K, group=self.group, stream=self.send_stream)
        received = mx.distributed.recv_like(x[-1], (rank - 1) % K, group=self.group, stream=self.stream)
        return mx.concatenate([mx.depends(received, sent)[None], x[:-1]])

    def _swap(self, x, partner):
        """Pairs within this process swap rows here; a pair across processes must have them ring
        neighbours (MLX's ring sends only to the next or previous process), and each neighbour gets
        one message: the rows of this process's workers paired with its workers, in worker order.
        Every process checks the whole pairing, so that all raise together.

        A receive has no inputs, so MLX may run it on its stream before anything else there: each
        is wrapped as depends(received, sent), as in _shift, which runs it after its send and all
        that the send waits on (the check's all-gather on the same sockets included). With two
        neighbours (`sim --processes`, 3 processes or more), a process takes its two links in the
        order of their numbers (link r joins processes r and r + 1 mod K): each link waits only on
        links of lower numbers, so no two processes wait on each other."""
        n, rank, K = self.n_local, self.group.rank(), self.group.size()
        for w, p in enumerate(partner):
            if (p // n - w // n) % K not in (0, 1, K - 1):
                raise ValueError(f"workers {w} and {p} are paired, but their processes ({w // n} and {p // n}) "
                                 "are no ring neighbours: MLX's ring sends only to the next or previous process")
        first = self.local_workers[0]
        rows = {w: x[w - first:w - first + 1] for w in self.local_workers}  # views: (1, ...) each
        out = {w: rows[partner[w]] for w in self.local_workers if partner[w] in rows}
        link = {(rank + 1) % K: rank, (rank - 1) % K: (rank - 1) % K}  # a neighbour -> the link's number
        got = None
        for peer in sorted({partner[w] // n for w in self.local_workers} - {rank}, key=link.get):
            mine = [w for w in self.local_workers if partner[w] // n == peer]
            message = x if mine == self.local_workers else mx.concatenate([rows[w] for w in mine])
            if got is not None:  # after the exchange with the other neighbour
                message = mx.depends(message, got)
            sent = mx.distributed.send(message, peer, group=self.group, stream=self.send_stream)
            theirs = [v for v in range(peer * n, peer * n + n) if partner[v] in rows]
            received = mx.distributed.recv((len(theirs), *x.shape[1:]), x.dtype, peer, group=self.group,
                                           stream=self.stream)
            got = mx.depends(received, sent)
            out.update({partner[v]: got[i:i + 1] for i, v in enumerate(theirs)})
        parts = [out[w] for w in self.local_workers]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)  # (one worker, on a cluster: no copy)

    @contextmanager
    def _watched(self):
        with watchdog(self.timeout_s):
            yield


def init_ring(timeout_s: float, workers_per_process: int = 1, backend: str = "ring") -> Communicator:
    """Join the group described by MLX's environment (under the watchdog: a peer that never comes
    up must not keep this process waiting forever): MLX_RANK and MLX_HOSTFILE for the ring; for
    jaccl MLX_RANK, MLX_IBV_DEVICES (the device matrix's file) and MLX_JACCL_COORDINATOR, as
    mlx.launch sets them (mlx/_distributed_utils/launch.py)."""
    variable = "MLX_IBV_DEVICES" if backend == "jaccl" else "MLX_HOSTFILE"
    path = os.environ.get(variable, "")
    if not path or not Path(path).is_file():
        raise ConfigError(f"{variable} ({path or 'unset'}) names no file; workers are started by "
                          f"'mlx-diloco launch', or by hand with MLX_RANK and {variable} set")
    if len(json.loads(Path(path).read_text())) == 1:  # alone, MLX's ring would wait for a peer forever
        return SimCommunicator(workers_per_process)
    with watchdog(max(timeout_s, 30.0)):
        group = mx.distributed.init(backend=backend, strict=True)
        if backend == "jaccl":  # every RDMA connection answers before training starts, within this watchdog
            mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group, stream=mx.cpu))
    return RingCommunicator(group, timeout_s, workers_per_process)
