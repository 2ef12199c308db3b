"""Timing MLX's ring between two processes, one on each end of a link (`mlx-diloco links`: the
agents start them, cluster/links.py turns the times into bandwidths).

At each message size: an all-reduce (all_sum of float32 values), then a send/recv in each
direction. A send/recv is timed by its sender as a round trip: it sends the message, the other
answers with one value once it has the whole message, so the time is the message's transfer plus
one small message's latency, and needs no clocks in step. Each op runs WARMUP times untimed, then
reps_for(size) times; a row holds the median. After each size the two sides agree on one set of
times (rank 0's all-reduce, each sender's send/recv), so both report the same rows. Sizes grow
until the list ends or an all-reduce took over `max_op_s` (the rate dominates long before). Every
wait on the peer runs under the watchdog (ring.py).
"""

import statistics
import time

import mlx.core as mx

from .watchdog import watchdog

WARMUP = 1
SMALL = 64 << 10  # bytes: up to this size an op takes little more than the latency; time it more often


def reps_for(nbytes: int) -> int:
    """Timed repetitions of each op at a size (the same on both sides, or their ops would not pair up)."""
    return 20 if nbytes <= SMALL else 3


def connect(timeout_s: float):
    """The two-process group of MLX_RANK and MLX_HOSTFILE (a peer that never comes up ends this one)."""
    with watchdog(max(timeout_s, 30.0)):
        return mx.distributed.init(backend="ring", strict=True)


def measure(group, sizes: list, timeout_s: float, max_op_s: float, on_row):
    """Time every op at every size; `on_row(op, sender, nbytes, seconds)` for each, with the times both
    sides agreed on: op "all_reduce" (sender None) or "send_recv" (sender: the rank that sent)."""
    rank = group.rank()
    peer = 1 - rank
    answer = mx.zeros((1,), mx.float32)

    def run(*ops):
        with watchdog(timeout_s):
            for op in ops:
                mx.eval(op())

    def all_reduce(x):
        run(lambda: mx.distributed.all_sum(x, group=group, stream=mx.cpu))

    def send_recv(x, sender):
        send = lambda y: mx.distributed.send(y, peer, group=group, stream=mx.cpu)  # noqa: E731
        recv = lambda y: mx.distributed.recv_like(y, peer, group=group, stream=mx.cpu)  # noqa: E731
        if rank == sender:
            run(lambda: send(x), lambda: recv(answer))
        else:
            run(lambda: recv(x), lambda: send(answer))

    def timed(fn, reps: int) -> float:
        for _ in range(WARMUP):
            fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    for nbytes in sizes:
        x = mx.ones((nbytes // 4,), mx.float32)
        mx.eval(x)
        reps = reps_for(nbytes)
        reduce_s = timed(lambda: all_reduce(x), reps)
        sent_s = [timed(lambda: send_recv(x, sender), reps) for sender in (0, 1)]
        # Each side contributes the times it owns (the other's entries are 0): the sum is the agreed set.
        mine = [reduce_s, sent_s[0], 0.0] if rank == 0 else [0.0, 0.0, sent_s[1]]
        with watchdog(timeout_s):
            agreed = mx.distributed.all_sum(mx.array(mine, mx.float32), group=group, stream=mx.cpu).tolist()
        on_row("all_reduce", None, nbytes, agreed[0])
        on_row("send_recv", 0, nbytes, agreed[1])
        on_row("send_recv", 1, nbytes, agreed[2])
        if agreed[0] > max_op_s:
            break
