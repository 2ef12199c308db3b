"""The communication interface that every strategy is written against.

Arrays exchanged between workers carry a leading *worker axis* over the workers that this
process hosts: all N of them in the simulator, one on a real cluster. With that convention an
all-reduce is "sum over the worker axis of every worker in the job", whichever transport runs
underneath.

A transport implements three primitives: `_sum_workers` (the ring's all-reduce),
`_gather_workers` (all-gather) and `_shift` (every worker receives its ring predecessor's array,
over MLX's neighbour send/recv). This base class builds the exchange on them, once for every
transport: one flat buffer per exchange (a bucket, not one collective per parameter), encoded by
a codec (codecs.py), and reduced by the cheapest algorithm that codec allows:

    summable codec (fp32, fp16, bf16)   ring all-reduce of x/M: sends 2(M-1)/M payloads
    quantized codec, M = 2              all-gather, decode, average: sends 1 payload
    quantized codec, M > 2              quantized ring: reduce-scatter then all-gather, each hop
                                        decoding, adding in fp32 and re-encoding its chunk
                                        (as PCCL does): sends 2(M-1)/M payloads

Exchanges start asynchronously on their own stream (so Streaming DiLoCo can overlap them with
inner steps); every wait on one is counted (and, on a cluster, watched), and every exchange is
recorded with the bytes one worker really sends.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .codecs import Codec, get_codec


def stack_copies(tree, n: int):
    """The same values for n workers, on a new leading axis."""
    return tree_map(lambda x: mx.broadcast_to(x[None], (n, *x.shape)), tree)


def replica(tree, i: int = 0):
    """Worker i's values of a tree of (n, ...) arrays, as views: MLX copies on an integer index
    (`x[i]`: a whole model's worth of memory for a model's parameters), not on a slice."""
    return tree_map(lambda x: x[i:i + 1].reshape(x.shape[1:]), tree)


def placeholders(tree):
    """Unevaluated zeros shaped like `tree`: its shapes and dtypes without its memory."""
    return tree_map(lambda x: mx.zeros(x.shape, x.dtype), tree)


def flatten_workers(tree):
    """A tree of (n, ...) arrays -> one (n, L) float32 buffer, and how to undo it."""
    flat = tree_flatten(tree)
    n = flat[0][1].shape[0]
    shapes = [(k, v.shape[1:]) for k, v in flat]
    buffer = mx.concatenate([v.reshape(n, -1).astype(mx.float32) for _, v in flat], axis=1)
    return buffer, shapes


def unflatten(buffer, shapes):
    """(..., L) -> the tree `flatten_workers` described, with the buffer's leading axes (if any)."""
    out, offset, lead = [], 0, buffer.shape[:-1]
    for key, shape in shapes:
        size = 1
        for d in shape:
            size *= d
        out.append((key, buffer[..., offset:offset + size].reshape(*lead, *shape)))
        offset += size
    return tree_unflatten(out)


def exchange_plan(codec: Codec, length: int, workers: int):
    """(algorithm, hops, payload bytes, bytes one worker sends) of a mean over `workers` of
    `length` values in `codec`: the cheapest algorithm the codec allows (module docstring)."""
    M, payload = workers, codec.wire_bytes(length)
    if codec.summable or M == 1:
        return "all_reduce", 2 * (M - 1), payload, 2 * (M - 1) * payload // M
    if M == 2:
        return "all_gather", M - 1, payload, (M - 1) * payload
    return "quantized_ring", 2 * (M - 1), payload, 2 * (M - 1) * codec.wire_bytes(-(-length // M))


def pack(wire: dict) -> mx.array:
    """A wire form's arrays as one (n, bytes) uint8 message. One message per transfer: a ring recv
    takes the next bytes on its socket, whichever of several concurrent sends wrote them."""
    n = next(iter(wire.values())).shape[0]
    return mx.concatenate([v.view(mx.uint8).reshape(n, -1) for v in wire.values()], axis=1)


def unpack(packed: mx.array, like: dict) -> dict:
    """`pack` undone, for messages of any number of workers (the leading axis of `packed`)."""
    out, offset, n = {}, 0, packed.shape[0]
    for k, v in like.items():
        size = v[0].nbytes
        out[k] = packed[:, offset:offset + size].view(v.dtype).reshape(n, *v.shape[1:])
        offset += size
    return out


@dataclass
class CollectiveRecord:
    algorithm: str        # "all_reduce", "quantized_ring" or "all_gather"
    codec: str
    payload_bytes: int    # one worker's contribution, on the wire
    sent_bytes: int       # what one worker sends
    hops: int             # sequential steps, each paying the link latency once
    tag: str = ""         # what was exchanged (e.g. "fragment 2")
    overlap_steps: int = 0  # inner steps of compute that run while it travels
    blocked_s: float = 0.0  # measured time this process waited for it
    done: bool = False


class Pending:
    """An exchange that has been started; `result()` waits for it and returns the mean."""

    def __init__(self, comm: "Communicator", out, record: CollectiveRecord, finish):
        self._comm, self._out, self.record, self._finish = comm, out, record, finish
        with comm._blocked(record):  # on the CPU stream, starting an exchange can block too
            mx.async_eval(out)

    def result(self):
        with self._comm._blocked(self.record):
            mx.eval(self._out)
        self.record.done = True
        return self._finish(self._out)


@dataclass
class Communicator:
    num_workers: int
    local_workers: list           # job-wide indices of the replicas on the leading axis
    records: list = field(default_factory=list)
    wait_s: float = 0.0           # time spent waiting for exchanges to finish

    def __post_init__(self):
        self.stream = mx.new_stream(mx.cpu)  # exchanges run here, beside the compute stream

    # ---- what a transport implements
    def _sum_workers(self, x: mx.array) -> mx.array:
        """(n_local, ...) -> (...): the sum over every worker in the job."""
        raise NotImplementedError

    def _gather_workers(self, x: mx.array) -> mx.array:
        """(n_local, ...) -> (num_workers, ...): every worker's slice, in worker order."""
        raise NotImplementedError

    def _shift(self, x: mx.array) -> mx.array:
        """(n_local, ...) -> (n_local, ...): each worker's row replaced by its ring predecessor's."""
        raise NotImplementedError

    @contextmanager
    def _watched(self):
        """Around every wait on another process (a transport adds its watchdog)."""
        yield

    @contextmanager
    def _blocked(self, record: CollectiveRecord = None):
        """Around every wait on an exchange: counts the time."""
        t0 = time.perf_counter()
        try:
            with self._watched():
                yield
        finally:
            waited = time.perf_counter() - t0
            self.wait_s += waited
            if record is not None:
                record.blocked_s += waited

    # ---- what strategies call
    @property
    def n_local(self) -> int:
        return len(self.local_workers)

    def all_mean(self, tree, codec="fp32", tag: str = ""):
        """Mean over all workers of a tree of (n_local, ...) arrays, exchanged through `codec`;
        returned in float32 without the worker axis."""
        return self.start_all_mean(tree, codec, tag).result()

    def start_all_mean(self, tree, codec="fp32", tag: str = "") -> Pending:
        buffer, shapes = flatten_workers(tree)
        return self.start_mean(buffer, codec, tag, shapes=shapes)

    def start_mean(self, buffer: mx.array, codec="fp32", tag: str = "", shapes=None) -> Pending:
        """Start the mean over all workers of an (n_local, L) float32 buffer; the result is (L,),
        or the tree `shapes` describes (see flatten_workers)."""
        codec = get_codec(codec) if isinstance(codec, str) else codec
        mx.eval(buffer)  # inputs are ready before the exchange starts: waits then measure only the exchange
        L = buffer.shape[1]
        algorithm, hops, payload, sent = exchange_plan(codec, L, self.num_workers)
        run = {"all_reduce": self._summed, "all_gather": self._gathered, "quantized_ring": self._quantized_ring}
        with mx.stream(self.stream):
            out = run[algorithm](buffer, codec)
        record = CollectiveRecord(algorithm, codec.name, payload, sent, hops, tag)
        self.records.append(record)
        return Pending(self, out, record, finish=lambda out: out[:L] if shapes is None else unflatten(out[:L], shapes))

    # ---- the three algorithms
    def _summed(self, buffer, codec):
        # MLX's ring adds fp16/bf16 in that dtype: scale by 1/M before the sum, not after.
        wire = codec.encode(buffer / self.num_workers)["values"]
        return self._sum_workers(wire).astype(mx.float32)

    def _gathered(self, buffer, codec):
        wire = codec.encode(buffer)
        gathered = unpack(self._gather_workers(pack(wire)), wire)
        return codec.decode(gathered, buffer.shape[1]).sum(axis=0) / self.num_workers

    def _quantized_ring(self, buffer, codec: Codec):
        """Reduce-scatter then all-gather around the ring, M chunks. At reduce-scatter hop s,
        worker w sends its running sum of chunk (w - s) mod M and adds its own values to the
        chunk it receives; after M - 1 hops it holds the full sum of chunk (w + 1) mod M, encoded,
        which then travels M - 1 hops so that every worker decodes the same bytes."""
        M, L = self.num_workers, buffer.shape[1]
        C = -(-L // M)
        chunks = mx.pad(buffer, [(0, 0), (0, M * C - L)]).reshape(self.n_local, M, C)
        me = mx.array(self.local_workers)

        def chunk(index):  # each local worker's chunk number index[w]: (n_local, C)
            return mx.take_along_axis(chunks, index[:, None, None], axis=1)[:, 0]

        def shift(wire):
            return unpack(self._shift(pack(wire)), wire)

        wire = codec.encode(chunk(me % M))
        for s in range(M - 1):
            wire = codec.encode(codec.decode(shift(wire), C) + chunk((me - 1 - s) % M))
        out = mx.zeros((self.n_local, M, C))
        for s in range(M):
            owned = (me + 1 - s) % M   # the chunk whose full sum this worker holds now
            placed = (mx.arange(M)[None, :] == owned[:, None])[..., None]
            out = mx.where(placed, codec.decode(wire, C)[:, None, :], out)
            if s < M - 1:
                wire = shift(wire)
        # Every worker holds the same values: the mean of the job, without the worker axis.
        return out[0].reshape(-1) / M

    def all_gather(self, wire: dict, tag: str = "") -> dict:
        """Every worker's arrays, for what cannot be summed (e.g. DeMo's top-k indices and values):
        {name: (n_local, ...)} -> {name: (num_workers, ...)}, sent as one message."""
        M, payload = self.num_workers, sum(v[0].nbytes for v in wire.values())
        record = CollectiveRecord("all_gather", "raw", payload, (M - 1) * payload, M - 1, tag)
        self.records.append(record)
        mx.eval(wire)
        with mx.stream(self.stream):
            out = unpack(self._gather_workers(pack(wire)), wire)
        return Pending(self, out, record, finish=lambda out: out).result()

    def gather_metric(self, values: mx.array) -> list:
        """Every worker's value of a per-worker measurement (e.g. its eval loss): (n_local,) -> a list
        of num_workers floats. Bookkeeping, not part of the algorithm: not counted as an exchange."""
        with mx.stream(self.stream):
            out = self._gather_workers(values.astype(mx.float32))
        with self._watched():
            return out.tolist()

    def broadcast_local(self, tree):
        """Give every local worker the same values: (...) -> (n_local, ...)."""
        return stack_copies(tree, self.n_local)

    def drain_records(self) -> list:
        """The records of the exchanges that have finished since the last call."""
        done = [r for r in self.records if r.done]
        self.records = [r for r in self.records if not r.done]
        return done


class SimCommunicator(Communicator):
    """All workers live in this process, stacked on the leading axis."""

    def __init__(self, num_workers: int):
        super().__init__(num_workers, list(range(num_workers)))

    def _sum_workers(self, x):
        return x.sum(axis=0)

    def _gather_workers(self, x):
        return x

    def _shift(self, x):
        return mx.roll(x, 1, axis=0)
