"""Model fragments for (Streaming) DiLoCo: which values sync together, when, and how.

The model's transformer blocks are dealt into P fragments, strided (block l in fragment l mod P,
the Streaming DiLoCo paper's default) or sequential (contiguous runs of blocks). Blocks are found
from parameter paths: `h.N.` (our GPT) or `layers.N.` (mlx-lm models). Everything outside the
blocks (token and position embeddings, an untied head, the final norm) is cut into P row ranges,
one per fragment: a fragment then holds the same share of those as of the blocks, so no single
exchange is larger than it must be. With P = 1 the one fragment is the whole model.

A fragment is a list of pieces (parameter path, first and last flat index of that parameter), so
its values form one flat buffer: one exchange per sync, and elementwise outer optimizers run on
it as they would on the tree.
"""

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..exchange.codecs import Codec
from ..exchange.worker_axis import replica
from ..models.zoo import BLOCK
from ..options import ConfigError
from ..schedules.schedule import SyncSchedule



@dataclass(frozen=True)
class Piece:
    path: str
    start: int   # flat offsets within the parameter (without the worker axis)
    stop: int


def partition(params, P: int, order: str = "strided") -> list:
    """P lists of Pieces that together cover every parameter exactly once."""
    flat = tree_flatten(params)
    blocks = sorted({int(m.group(1)) for k, _ in flat if (m := BLOCK.search(k))})
    if P > max(len(blocks), 1):
        raise ConfigError(f"{P} fragments but the model has {len(blocks)} blocks; pass --fragments "
                          f"{max(len(blocks), 1)} or fewer")
    if order == "strided":
        owner = {b: i % P for i, b in enumerate(blocks)}
    else:  # sequential: contiguous runs, the first ones one block longer when P does not divide
        owner = {b: min(i * P // len(blocks), P - 1) for i, b in enumerate(blocks)}
    fragments = [[] for _ in range(P)]
    for path, value in flat:
        m = BLOCK.search(path)
        if m:
            fragments[owner[int(m.group(1))]].append(Piece(path, 0, value.size))
            continue
        # Outside the blocks: P ranges of whole rows, or (a vector) the whole array to the last fragment.
        rows = value.shape[0] if value.ndim > 1 else 1
        if rows < P:
            fragments[P - 1].append(Piece(path, 0, value.size))
            continue
        row = value.size // rows
        for p in range(P):
            fragments[p].append(Piece(path, rows * p // P * row, rows * (p + 1) // P * row))
    return fragments


def gather(flat_params: dict, pieces: list) -> mx.array:
    """The pieces' values as one (n, L) buffer; `flat_params` maps paths to (n, ...) arrays."""
    n = next(iter(flat_params.values())).shape[0]
    return mx.concatenate([flat_params[p.path].reshape(n, -1)[:, p.start:p.stop].astype(mx.float32)
                           for p in pieces], axis=1)


def scatter(flat_params: dict, pieces: list, values: mx.array) -> dict:
    """`flat_params` with the pieces' values replaced by an (n, L) buffer (cast to each dtype)."""
    out, offset = dict(flat_params), 0
    for p in pieces:
        old = out[p.path]
        n, size = old.shape[0], p.stop - p.start
        part = values[:, offset:offset + size].astype(old.dtype)
        if p.start == 0 and p.stop == old.size // n:
            out[p.path] = part.reshape(old.shape)
        else:
            flat = old.reshape(n, -1)
            out[p.path] = mx.concatenate([flat[:, :p.start], part, flat[:, p.stop:]], axis=1).reshape(old.shape)
        offset += size
    return out


def offload_folder() -> tempfile.TemporaryDirectory:
    """A scratch folder for offloaded outer state, removed with the strategy. A process killed
    outright (an agent kills a stalled worker with SIGKILL) cannot remove its own, and a 1B
    model's is 8.8 GB: the folders of processes that no longer run are removed here first."""
    for old in Path(tempfile.gettempdir()).glob("mlx-diloco-outer-*-*"):
        try:
            os.kill(int(old.name.split("-")[3]), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, PermissionError):  # not ours, or another user's live process
            pass
    return tempfile.TemporaryDirectory(prefix=f"mlx-diloco-outer-{os.getpid()}-")


class OuterStore:
    """A fragment's global values and outer optimizer state: in memory, or (`folder` given) each in
    a safetensors file between the syncs that use them, out of the training memory."""

    def __init__(self, global_values: mx.array, outer: optim.Optimizer, folder=None, name: str = ""):
        self.outer, self.size = outer, global_values.size
        self.file = f"{folder}/{name}.safetensors" if folder else None               # global values
        self.outer_file = f"{folder}/{name}-outer.safetensors" if folder else None   # outer state
        mx.eval(global_values)  # not a lazy view: that would keep the whole initial model alive
        outer.init({"p": global_values})
        self.global_values, self.outer_state = global_values, outer.state

    @property
    def global_values(self) -> mx.array:
        return mx.load(self.file)["global"] if self.file else self._global

    @global_values.setter
    def global_values(self, values: mx.array):
        if self.file:
            mx.save_safetensors(self.file, {"global": values})
        else:
            self._global = values

    @property
    def outer_state(self) -> dict:
        """The outer optimizer's state, its per-value arrays ("p") read back when offloaded."""
        if not self.file:
            return self.outer.state
        return {**self.outer.state, "p": tree_unflatten(list(mx.load(self.outer_file).items()))}

    @outer_state.setter
    def outer_state(self, state: dict):
        if self.file:
            mx.save_safetensors(self.outer_file, dict(tree_flatten(state["p"])))
            state = {k: v for k, v in state.items() if k != "p"}  # the step count, the lr stay
        self.outer.state = state


class Fragment:
    """One fragment's sync state: its global values (L,), its own outer optimizer (and its state),
    an error-feedback buffer, and the exchange in flight.

    It sends at steps t with (t - offset) mod H == 0 and applies the result `delay` (tau) steps
    later: an outer step on its global values, then the merge  local <- alpha * local +
    (1 - alpha) * global  on every local worker."""

    def __init__(self, index: int, pieces: list, global_values: mx.array, outer: optim.Optimizer,
                 sync_every: int, offset: int, delay: int, alpha: float, codec: Codec,
                 error_feedback: bool, n_local: int, offload_dir=None):
        if not 0 <= offset < sync_every:
            raise ValueError(f"fragment {index}: offset {offset} outside [0, {sync_every})")
        if not 0 <= delay < sync_every:
            raise ValueError(f"fragment {index}: overlap of {delay} steps must be below H = {sync_every}")
        if not 0 <= alpha <= 1:
            raise ValueError(f"fragment {index}: merge alpha {alpha} outside [0, 1]")
        self.index, self.pieces = index, pieces
        self.sync_every, self.offset, self.delay = sync_every, offset, delay
        self.schedule = SyncSchedule(sync_every, (offset,), delay)  # when this fragment syncs
        self.alpha, self.codec, self.outer = alpha, codec, outer
        self.store = OuterStore(global_values, outer, offload_dir, f"fragment-{index}")
        self.error = mx.zeros((n_local, global_values.size)) if error_feedback else None
        self.pending, self.apply_at, self.sent = None, None, None

    @property
    def size(self) -> int:
        return self.store.size

    @property
    def global_values(self) -> mx.array:
        return self.store.global_values

    @global_values.setter
    def global_values(self, values: mx.array):
        self.store.global_values = values

    def is_send_step(self, step: int) -> bool:
        return self.schedule.syncs(step)

    def round_length(self, step: int) -> int:
        """Inner steps since this fragment last sent (or since the start), as of `step`."""
        return self.schedule.round_length(self.offset, step)

    def prepare_sync(self, flat_params: dict, comm, step: int, weights=None):
        """Start exchanging the pseudo-gradient  global - local  (plus what compression lost last
        time); `weights`, one per local worker, scale what each sends (the mean becomes weighted)."""
        delta = self.global_values[None] - gather(flat_params, self.pieces)
        if weights is not None:
            delta = delta * mx.array(weights)[:, None]
        if self.error is not None:  # what the last exchange lost of this worker's part (comm.py's `lost`)
            delta = delta + self.error
        self._start(delta, comm, apply_at=step + self.delay)

    def _start(self, delta, comm, apply_at: int):
        self.sent, self.apply_at = delta, apply_at  # kept until it lands: a checkpoint can restart it
        self.pending = comm.start_mean(delta, self.codec, tag=f"fragment {self.index}", feedback=self.error is not None)
        self.pending.record.overlap_steps = self.delay

    def perform_sync(self, flat_params: dict, final: bool = False, short_round: bool = False) -> dict:
        """Wait for the exchange, take the outer step, merge into every local worker (at the end of
        a run every worker takes the global values as they are).

        `short_round`: the run's last round was shorter than H. Its pseudo-gradient is a fraction of
        a full round's, but the outer step's momentum is that of full rounds: it would step on past
        the workers (measured: eval loss 5.3833 against workers at 5.352-5.354 with H = 30 and a
        10-step last round; 5.3595 against 5.288-5.295 with H = 50 and 20). The global values become
        the workers' mean instead (5.3519 and 5.2880), and the outer state is left as it is."""
        mean_delta = self.pending.result()
        if self.error is not None:  # replaced when the exchange lands: until then a checkpoint keeps the one it sent
            self.error = self.pending.lost
        self.pending, self.apply_at, self.sent = None, None, None
        if short_round:  # a last round shorter than H: the workers' mean (an outer step would overshoot)
            global_values = self.store.global_values - mean_delta
            mx.eval(global_values)
            self.store.global_values = global_values
        else:
            self.outer.state = self.store.outer_state
            global_values = self.outer.apply_gradients({"p": mean_delta}, {"p": self.store.global_values})["p"]
            mx.eval(global_values, self.outer.state)
            self.store.global_values, self.store.outer_state = global_values, self.outer.state
        merged = global_values[None]
        if self.alpha > 0 and not final:
            merged = self.alpha * gather(flat_params, self.pieces) + (1 - self.alpha) * merged
        else:
            merged = mx.broadcast_to(merged, (next(iter(flat_params.values())).shape[0], self.size))
        out = scatter(flat_params, self.pieces, merged)
        mx.eval([out[p.path] for p in self.pieces])  # done now: syncs in a row hold one fragment's buffers at a time
        return out

    def state(self) -> dict:
        """Global values (fp32, exact), outer optimizer state, error-feedback buffer, and an exchange
        in flight (what this worker sent). Offloaded, the arrays are lazy reads of their files: a
        checkpoint writes them one at a time (training/checkpoint.py)."""
        out = {"global": self.store.global_values, "outer": self.store.outer_state}
        if self.error is not None:
            out["error"] = self.error
        if self.pending is not None:
            out["in_flight"] = {"sent": self.sent, "apply_at": mx.array(self.apply_at)}
        return out

    def load_state(self, state: dict, comm):
        """Restore, and start again the exchange that was in flight: every worker resends what it sent."""
        self.store.global_values = state["global"]
        self.store.outer_state = state["outer"]
        if self.error is not None:
            self.error = state["error"]
        if "in_flight" in state:
            self._start(state["in_flight"]["sent"], comm, apply_at=state["in_flight"]["apply_at"].item())


def global_tree(params, parts):
    """The global model (no worker axis): each part's global values, an iterable of (pieces, values)
    pairs, in their places, cast to the dtypes of `params`. Fresh zeros underneath: the values
    of `params` (placeholders, say) are not read, so they are not evaluated and kept either."""
    flat = {k: mx.zeros((1, *v.shape), v.dtype) for k, v in tree_flatten(params)}
    for pieces, values in parts:
        flat = scatter(flat, pieces, values[None])
        mx.eval([flat[p.path] for p in pieces])  # one fragment's fp32 values in memory at a time
    return replica(tree_unflatten(list(flat.items())))
