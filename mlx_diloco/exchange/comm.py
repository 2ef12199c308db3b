"""The communication interface that every strategy is written against.

Arrays exchanged between workers carry a leading *worker axis* over the workers that this
process hosts: all N of them in the simulator, one on a real cluster. With that convention an
all-reduce is "sum over the worker axis of every worker in the job", whichever transport runs
underneath.

A transport implements four primitives: `_sum_workers` (the ring's all-reduce),
`_gather_workers` (all-gather), `_shift` (every worker receives its ring predecessor's array,
over MLX's neighbour send/recv) and `_swap` (every worker of a pairing receives its partner's,
the same way). This base class builds the exchange on them, once for every
transport: one flat buffer per exchange (a bucket, not one collective per parameter), encoded by
a codec (codecs.py), and reduced by the cheapest algorithm that codec allows:

    summable codec (fp32, fp16, bf16)   ring all-reduce of x/M: sends 2(M-1)/M payloads
    quantized codec, M = 2              all-gather, decode, average: sends 1 payload
    quantized codec, M > 2              quantized ring: reduce-scatter then all-gather, each hop
                                        decoding, adding in fp32 and re-encoding its chunk
                                        (as PCCL does): sends 2(M-1)/M payloads

A pair mean (`start_pair_mean`, NoLoCo's gossip) is no mean over the job: each worker of a pair
sends its encoded values to the other (1 payload), and both average the same decoded values.

Before every exchange the workers all-gather three float32 numbers each (CHECK_BYTES, counted in
the bytes sent): their largest magnitude, from which the summed codecs take the unit every
worker divides by (codecs.py), whether any of their values is NaN or inf, and how long after they
last left a wait on their peers they arrived. A NaN or an inf never reaches the mean: when the
exchange is waited on, every worker of the job raises NonFiniteValues naming the same workers
(peers on a ring stop together; none waits on another). The arrival times split a worker's wait in
two: the workers leave a collective together, so the last one's arrival minus this one's is time
spent waiting for slower workers; the rest of the wait is the link.

Exchanges start asynchronously on their own stream (so Streaming DiLoCo can overlap them with
inner steps); every wait on one is counted (and, on a cluster, watched), and every exchange is
recorded with the bytes one worker really sends.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .codecs import CHECK_BYTES, Codec, get_codec, unit_of
from .worker_axis import flatten_workers, stack_copies, unflatten


class NonFiniteValues(RuntimeError):
    """Some workers' values held NaN or inf; `workers` (job-wide indices) and the exchange's `tag`
    (or what was checked)."""

    def __init__(self, workers, tag: str, verb: str = "sent"):
        self.workers, self.tag = sorted(workers), tag
        who = f"worker {self.workers[0]}" if len(self.workers) == 1 else f"workers {', '.join(map(str, self.workers))}"
        super().__init__(f"{who} {verb} non-finite values (NaN or inf)" + (f" in {tag}" if tag else ""))


def exchange_plan(codec: Codec, length: int, workers: int):
    """(algorithm, hops, payload bytes, bytes one worker sends) of a mean over `workers` of
    `length` values in `codec`: the cheapest algorithm the codec allows (module docstring), after
    the check's all-gather (M - 1 hops of CHECK_BYTES)."""
    M, payload = workers, codec.wire_bytes(length)
    check_hops, check_sent = M - 1, (M - 1) * CHECK_BYTES
    if codec.summable:
        payload -= codec.shared_unit_bytes  # the unit is shared through the check, not sent
        return "all_reduce", 2 * (M - 1) + check_hops, payload, 2 * (M - 1) * payload // M + check_sent
    if M <= 2:  # (one worker: a gather of itself, nothing sent)
        return "all_gather", M - 1 + check_hops, payload, (M - 1) * payload + check_sent
    chunk = codec.wire_bytes(-(-length // M))
    return "quantized_ring", 2 * (M - 1) + check_hops, payload, 2 * (M - 1) * chunk + check_sent


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
    algorithm: str        # "all_reduce", "quantized_ring", "all_gather" or "pair_mean"
    codec: str
    payload_bytes: int    # one worker's contribution, on the wire
    sent_bytes: int       # what one worker sends
    hops: int             # sequential steps, each paying the link latency once
    tag: str = ""         # what was exchanged (e.g. "fragment 2")
    overlap_steps: int = 0  # inner steps of compute that run while it travels
    blocked_s: float = 0.0  # measured time this process waited for it
    straggler_s: float = 0.0  # of which: waiting for the last worker to arrive
    done: bool = False


class Pending:
    """An exchange that has been started (or is held until it reaches the link); `result()` waits
    for it and returns the mean, or raises NonFiniteValues if any worker's values were not finite.
    `lost` (when asked for): what the whole exchange lost of each local worker's part, (n_local, L),
    once `result()` has returned.

    `build()` makes the exchange's graph on the exchange stream when it reaches the link: now, or
    when the communicator stops holding exchanges (`Communicator.exchanges_held`). It returns the
    result, the collectives' results (`messages`: the check's first), the check and `lost`.
    Starting it runs its collectives and what they need (the encoding before the check: `_after`);
    what comes after them (decoding, the mean)
    runs when the result is asked for. MLX's async_eval stops its caller while more than 10 tasks
    (of 10 ops each) wait to finish, and every op queued behind a collective on its stream waits for
    the collective: an exchange started with its decoding kept the training loop waiting for the
    link (Streaming int4 on the emulated cluster: 259 ms blocked per exchange, 161 ms with this;
    bench/cluster_streaming.py). A quantized ring's hops each decode and re-encode behind the one
    before: with many workers they may still pass it."""

    def __init__(self, comm: "Communicator", record: CollectiveRecord, build, finish):
        self._comm, self.record, self._build, self._finish = comm, record, build, finish
        self._out = self._check = self.lost = None
        if comm._held is None:
            self._start()
        else:
            comm._held.append(self)

    def _start(self):
        with mx.stream(self._comm.stream):
            self._out, messages, self._check, self.lost = self._build()
        with self._comm._blocked(self.record):  # on the CPU stream, starting an exchange can block too
            mx.async_eval(*messages)

    def result(self):
        if self._out is None:  # held: it starts now, after those held before it
            self._comm._start_held()
        with self._comm._blocked(self.record):
            mx.eval(self._out, *[a for a in (self._check, self.lost) if a is not None])
        self.record.done = True
        if self._check is not None:
            self._comm._count_straggling(self.record, self._check[:, 2].tolist())
            bad = [w for w, flag in enumerate(self._check[:, 1].tolist()) if flag]
            if bad:
                raise NonFiniteValues(bad, self.record.tag)
        return self._finish(self._out)


@dataclass
class Communicator:
    num_workers: int
    local_workers: list           # job-wide indices of the replicas on the leading axis
    records: list = field(default_factory=list)
    wait_s: float = 0.0           # time spent waiting for exchanges to finish
    straggler_s: float = 0.0      # of which: waiting for slower workers to arrive (the rest: the link)

    def __post_init__(self):
        self.stream = mx.new_stream(mx.cpu)  # exchanges run here, beside the compute stream
        self._left_at = time.perf_counter()  # when this process last left a wait on its peers
        self._held = None                    # exchanges started while held, not yet on the link

    @contextmanager
    def exchanges_held(self):
        """Exchanges started inside reach the link as it ends, in the order they were started (one
        whose result is asked for first takes those before it along): the run's own collectives of a
        tick (an evaluation's gathers, a checkpoint's checks) then go first, where they would wait
        behind a new exchange on the link. After an error nothing held starts: every process stops."""
        self._held = []
        try:
            yield
            self._start_held()
        finally:
            self._held = None

    def _start_held(self):
        held, self._held = self._held, []
        for pending in held:
            pending._start()

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

    def _swap(self, x: mx.array, partner: list) -> mx.array:
        """(n_local, ...) -> (n_local, ...): each worker w's row replaced by that of worker
        partner[w] (job-wide indices; partner[w] == w: its own)."""
        raise NotImplementedError

    @contextmanager
    def _watched(self):
        """Around every wait on another process (a transport adds its watchdog)."""
        yield

    @contextmanager
    def _with_peers(self):
        """Around every wait on the other processes: watched, and noting when it ended."""
        try:
            with self._watched():
                yield
        finally:
            self._left_at = time.perf_counter()

    @contextmanager
    def _blocked(self, record: CollectiveRecord = None):
        """Around every wait on an exchange: counts the time."""
        t0 = time.perf_counter()
        try:
            with self._with_peers():
                yield
        finally:
            waited = time.perf_counter() - t0
            self.wait_s += waited
            if record is not None:
                record.blocked_s += waited

    def _count_straggling(self, record: CollectiveRecord, arrived: list):
        """The part of an exchange's wait spent for the last worker to arrive (`arrived`: every
        worker's time from its last wait on peers to the exchange's start)."""
        late = min(record.blocked_s, max(0.0, max(arrived) - arrived[self.local_workers[0]]))
        record.straggler_s += late
        self.straggler_s += late

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

    def start_mean(self, buffer: mx.array, codec="fp32", tag: str = "", shapes=None,
                   feedback: bool = False) -> Pending:
        """Start the mean over all workers of an (n_local, L) float32 buffer; the result is (L,),
        or the tree `shapes` describes (see flatten_workers). With `feedback`, the Pending's `lost`
        is what compression took from each local worker's part of the mean, over the whole
        exchange: adding it to the worker's next buffer is error feedback."""
        codec = get_codec(codec) if isinstance(codec, str) else codec
        mx.eval(buffer)  # inputs are ready before the exchange starts: waits then measure only the exchange
        L = buffer.shape[1]
        algorithm, hops, payload, sent = exchange_plan(codec, L, self.num_workers)
        run = {"all_reduce": self._summed, "all_gather": self._gathered, "quantized_ring": self._quantized_ring}

        def build():
            check = self._check([buffer])
            messages = [check]
            out, lost = run[algorithm](buffer, codec, check, feedback, messages)
            return out, messages, check, lost

        record = CollectiveRecord(algorithm, codec.name, payload, sent, hops, tag)
        self.records.append(record)
        return Pending(self, record, build, finish=lambda out: out[:L] if shapes is None else unflatten(out[:L], shapes))

    def start_pair_mean(self, buffer: mx.array, partner: list, codec="fp32", tag: str = "") -> Pending:
        """Start a gossip round: each worker w's mean of its (n_local, L) float32 values and those
        of worker partner[w] (job-wide indices, each the other's partner; partner[w] == w: w sits
        out and keeps its values). The result is (n_local, L). Each paired worker sends its values
        once, encoded with its own unit; both ends average the same decoded values (a + b is b + a),
        so a pair holds one mean. The check comes first, as for every exchange: a NaN or an inf
        stops every worker of the job, not only its partner."""
        M, L = self.num_workers, buffer.shape[1]
        if sorted(partner) != list(range(M)) or any(partner[p] != w for w, p in enumerate(partner)):
            raise ValueError(f"a pairing gives each of the {M} workers a partner whose partner it is (got {partner})")
        codec = get_codec(codec) if isinstance(codec, str) else codec
        mx.eval(buffer)
        paired = mx.array([partner[w] != w for w in self.local_workers])[:, None]

        def build():
            check = self._check([buffer])
            wire = codec.encode(buffer, salt=mx.array(self.local_workers))
            swapped = self._swap(self._after(check, pack(wire)), partner)
            theirs = codec.decode(unpack(swapped, wire), L)
            return mx.where(paired, (codec.decode(wire, L) + theirs) / 2, buffer), [check, swapped], check, None

        pairs = any(p != w for w, p in enumerate(partner))
        payload = codec.wire_bytes(L)  # what a paired worker sends (one that sits out: the check only)
        record = CollectiveRecord("pair_mean", codec.name, payload, payload * pairs + (M - 1) * CHECK_BYTES,
                                  M - 1 + pairs, tag)
        self.records.append(record)
        return Pending(self, record, build, finish=lambda out: out)

    def _check(self, arrays: list) -> mx.array:
        """(num_workers, 3) float32: every worker's largest magnitude over `arrays` (each
        (n_local, ...)), 1 where any of its values is NaN or inf, and the seconds since it last left
        a wait on its peers, all-gathered (CHECK_BYTES each).
        Reductions only, no temporary the size of the values: max and min carry a NaN or an inf
        through (and a worker with one stops the run, so its magnitude is never used)."""
        top = mx.zeros((self.n_local,))
        for a in arrays:
            a = a.reshape(self.n_local, -1)
            top = mx.maximum(top, mx.maximum(a.max(axis=1), -a.min(axis=1)).astype(mx.float32))
        arrived = mx.full((self.n_local,), time.perf_counter() - self._left_at)
        return self._gather_workers(mx.stack([top, (~mx.isfinite(top)).astype(mx.float32), arrived], axis=1))

    # ---- the three algorithms: each returns the mean (L',) and, with feedback, what it lost (n_local, L),
    # and appends its collectives' results to `messages` (what starting the exchange runs: Pending).
    # Each encodes before the check (it needs no peer) and sends after it (`_after`).
    @staticmethod
    def _after(check, message):
        """`message`, sent once the check is done: every process runs its collectives in one order
        (the check's, then the exchange's), and what needs no peer, the encoding, runs before it: an
        exchange started while a peer is late queues no encoding behind the check, where MLX's
        10-task limit stopped the caller until the peer came (int4, 4.7M values, two processes in
        network namespaces at 100 Mbit/s, one 0.3 s late: 330 ms blocked at the start, now 20-43)."""
        return mx.depends(message, check)

    def _summed(self, buffer, codec, check, feedback, messages):
        # MLX's ring adds fp16/bf16 in that dtype: scale by 1/M before the sum, not after, and divide
        # by a unit every worker shares (from the check's largest magnitude): the sum stays in range.
        M, L = self.num_workers, buffer.shape[1]
        shared = {}
        if codec.shared_unit_bytes:
            shared["unit"] = mx.broadcast_to(unit_of(mx.max(check[:, 0])), (self.n_local, 1))
        wire = codec.encode(buffer / M, **shared)
        messages.append(self._sum_workers(self._after(check, wire["values"])))
        total = messages[-1][None]
        out = codec.decode({**wire, "values": total, **{k: v[:1] for k, v in shared.items()}}, L).reshape(-1)  # a view: x[0] copies
        return out, (buffer - M * codec.decode(wire, L)) if feedback else None

    def _gathered(self, buffer, codec, check, feedback, messages):
        me = mx.array(self.local_workers)
        wire = codec.encode(buffer, salt=me)
        messages.append(self._gather_workers(self._after(check, pack(wire))))
        gathered = unpack(messages[-1], wire)
        out = codec.decode(gathered).sum(axis=0) / self.num_workers  # padded: finish() slices (Codec.decode)
        return out, (buffer - codec.decode(wire, buffer.shape[1])) if feedback else None

    def _quantized_ring(self, buffer, codec: Codec, check, feedback, messages):
        """Reduce-scatter then all-gather around the ring, M chunks. At reduce-scatter hop s,
        worker w sends its running sum of chunk (w - s) mod M and adds its own values to the
        chunk it receives; after M - 1 hops it holds the full sum of chunk (w + 1) mod M, encoded,
        which then travels M - 1 hops so that every worker decodes the same bytes.

        Each worker encodes every chunk once (its own values first, then each running sum it
        passes on, the last one the full sum): the mean lacks the sum of those M encoding errors
        over the workers, so each worker's `lost` is its own, chunk by chunk."""
        M, L = self.num_workers, buffer.shape[1]
        C = -(-L // M)
        chunks = mx.pad(buffer, [(0, 0), (0, M * C - L)]).reshape(self.n_local, M, C)
        me = mx.array(self.local_workers)
        lost = mx.zeros((self.n_local, M, C)) if feedback else None

        def chunk(index):  # each local worker's chunk number index[w]: (n_local, C)
            return mx.take_along_axis(chunks, index[:, None, None], axis=1)[:, 0]

        def place(index, values, into):  # `into` (n_local, M, C) with chunk index[w] of row w replaced
            placed = (mx.arange(M)[None, :] == index[:, None])[..., None]
            return mx.where(placed, values[:, None, :], into)

        def encode(values, index):  # this worker's running sum of chunk `index`, noting what encoding loses
            nonlocal lost
            wire = codec.encode(values, salt=me)
            if feedback:
                lost = place(index, values - codec.decode(wire, C), lost)
            return wire

        def shift(wire):
            messages.append(self._shift(self._after(check, pack(wire))))
            return unpack(messages[-1], wire)

        wire = encode(chunk(me % M), me % M)
        for s in range(M - 1):
            index = (me - 1 - s) % M
            wire = encode(codec.decode(shift(wire), C) + chunk(index), index)
        # Every worker ends with the same values, so the first local one's are decoded: at step s it
        # holds the full sum of chunk (w + 1 - s) mod M
        first = self.local_workers[0]
        sums = []
        for s in range(M):
            sums.append(codec.decode({k: v[:1] for k, v in wire.items()}, C)[0])
            if s < M - 1:
                wire = shift(wire)
        out = mx.concatenate([sums[(first + 1 - j) % M] for j in range(M)])
        return out / M, lost.reshape(self.n_local, -1)[:, :L] if feedback else None

    def all_gather(self, wire: dict, tag: str = "") -> dict:
        """Every worker's arrays, for what cannot be summed (e.g. DeMo's top-k indices and values):
        {name: (n_local, ...)} -> {name: (num_workers, ...)}, sent as one message, after the check
        of their floating-point values."""
        M, payload = self.num_workers, sum(v[0].nbytes for v in wire.values())
        record = CollectiveRecord("all_gather", "raw", payload, (M - 1) * (payload + CHECK_BYTES), 2 * (M - 1), tag)
        self.records.append(record)
        mx.eval(wire)
        floats = [v for v in wire.values() if mx.issubdtype(v.dtype, mx.floating)]

        def build():
            check = self._check(floats or [mx.zeros((self.n_local, 1))])
            gathered = self._gather_workers(self._after(check, pack(wire)))
            return unpack(gathered, wire), [check, gathered], check, None

        return Pending(self, record, build, finish=lambda out: out).result()

    def check_finite(self, tree, what: str):
        """Raise NonFiniteValues on every worker if any worker's floating-point arrays in `tree`
        (each (n_local, ...)) hold NaN or inf: what no exchange has checked yet, e.g. the weights
        of fragments that have not synced, before a checkpoint keeps them."""
        arrays = [v for _, v in tree_flatten(tree) if mx.issubdtype(v.dtype, mx.floating)]
        with mx.stream(self.stream):
            check = self._check(arrays)
        with self._with_peers():
            bad = [w for w, flag in enumerate(check[:, 1].tolist()) if flag]
        if bad:
            raise NonFiniteValues(bad, what, verb="holds")

    def gather_metric(self, values: mx.array) -> list:
        """Every worker's value of a per-worker measurement (e.g. its eval loss): (n_local,) -> a list
        of num_workers floats ((n_local, k): of lists of k). Bookkeeping, not part of the algorithm:
        not counted as an exchange."""
        with mx.stream(self.stream):
            out = self._gather_workers(values.astype(mx.float32))
        with self._with_peers():
            return out.tolist()

    def broadcast(self, tree, source: int):
        """The values of a tree held by the process hosting worker `source`, to every process: a sum
        to which every other process adds zeros, so the values arrive exact."""
        mine = source in self.local_workers
        # One order in every process (a state read back from a checkpoint has its keys sorted), and one
        # collective at a time: MLX may order a graph's independent collectives differently in each process.
        flat = sorted(tree_flatten(tree), key=lambda kv: kv[0])
        summed = []
        with self._blocked():
            for _, v in flat:
                summed.append(self._sum_workers((v if mine else mx.zeros_like(v))[None]))
                mx.eval(summed[-1])
        return tree_unflatten([(k, v) for (k, _), v in zip(flat, summed)])

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

    def _swap(self, x, partner):
        return x[mx.array(partner)]
