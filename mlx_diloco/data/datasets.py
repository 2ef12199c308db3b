"""Training data: where it comes from, how it is tokenized and cached, and how workers read it.

Text is tokenized once (byte-level BPE trained on the corpus, or a given tokenizer folder) and
cached as .npy token arrays that are memory-mapped afterwards. A dataset is a list of examples
(for text: windows of seq_len + 1 tokens; for images: image and label). Each worker reads a
disjoint shard through a `ShardSampler` whose cursor (epoch, position) is saved in checkpoints,
so iteration is deterministic and resumable.
"""

import gzip
import io
import hashlib
import json
import lzma
import os
import shutil
from importlib import resources
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from ..config import ConfigError
from . import EMBEDDED, FASHION_MNIST  # noqa: F401 (the rest imports them from here too)
from .hf_tokenizer import hf_tokenizer
from .jsonl import is_jsonl, load_jsonl

VAL_FRACTION = 0.05
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                       "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
FASHION_MNIST_URL = "https://github.com/zalandoresearch/fashion-mnist/tree/master/data/fashion"


def cache_root() -> Path:
    return Path(os.environ.get("MLX_DILOCO_CACHE", Path.home() / ".cache" / "mlx-diloco"))


# ---------------------------------------------------------------- text sources

def load_text(source: str, log=print) -> str:
    """The embedded Shakespeare corpus, a text file, or every .txt file of a folder (sorted)."""
    if source == EMBEDDED:
        with resources.files("mlx_diloco").joinpath("data/shakespeare.txt.xz").open("rb") as f:
            return lzma.decompress(f.read()).decode("utf-8")
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data path {path} does not exist; pass a text file, a folder of .txt files, "
                          f"'{EMBEDDED}' or '{FASHION_MNIST}'")
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"data folder {path} holds no .txt files; put your text in .txt files")
    text = "\n\n".join(decode_text(f.read_bytes(), f, log) for f in files)
    if len(text) < 1000:
        raise ConfigError(f"data {path} holds only {len(text)} characters; give at least a few kB of text")
    return text


# How what reading a text file says begins: sim's processes read the data again after sim has
# (cli.cmd_worker), and leave these lines to it.
TEXT_NOTICES = ("data file ", "warning: data file ")


def decode_text(raw: bytes, path, log=print) -> str:
    """UTF-8 text; a file with no valid UTF-8 multi-byte sequence at all is Windows-1252/Latin-1
    (the usual other encoding of old text files). Binary files are refused."""
    head = raw[:1 << 16]
    control = sum(b < 32 and b not in b"\t\n\r\f\v" for b in head)
    if b"\0" in head or control > len(head) // 100:
        raise ConfigError(f"data file {path} is not text (it holds NUL or control bytes); "
                          "pass UTF-8 or Latin-1 text files")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    text = raw.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    has_utf8 = any(ord(c) > 127 and c != "\ufffd" for c in text)
    if not has_utf8:
        log(f"data file {path} is not UTF-8; read it as Windows-1252 (Latin-1)")
        try:
            return raw.decode("cp1252")
        except UnicodeDecodeError:  # one of the five bytes cp1252 leaves undefined: plain Latin-1
            return raw.decode("latin-1")
    log(f"warning: data file {path} is UTF-8 with {replaced} invalid byte sequences; "
        "they were replaced with U+FFFD")
    return text


# ---------------------------------------------------------------- tokenizers

def train_bpe(text: str, vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer on `text`; save it as an HF tokenizer folder (mlx-lm loads it)."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    lines = (line for line in text.splitlines(keepends=True))
    tok.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>", "model_max_length": 1 << 20}))


class Tokenizer:
    """Encode/decode with a tokenizer folder: fast path through `tokenizers`, else mlx-lm's loader."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if (self.folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer as FastTokenizer
            self._fast = FastTokenizer.from_file(str(self.folder / "tokenizer.json"))
            self._hf = None
            self.vocab_size = self._fast.get_vocab_size()
        else:
            self._fast = None
            self._hf = hf_tokenizer(self.folder)
            self.vocab_size = len(self._hf.vocab)

    def encode(self, text: str) -> list:
        if self._fast is not None:
            return self._fast.encode(text).ids
        return self._hf.encode(text, add_special_tokens=False)

    def encode_corpus(self, text: str) -> np.ndarray:
        chunks = [text[i:i + 100_000] for i in range(0, len(text), 100_000)]
        if self._fast is not None:
            ids = [e.ids for e in self._fast.encode_batch(chunks)]
        else:
            ids = [self.encode(c) for c in chunks]
        return np.fromiter((t for chunk in ids for t in chunk), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._fast.decode(list(ids)) if self._fast is not None else self._hf.decode(list(ids))


# ---------------------------------------------------------------- datasets

class TokenExamples:
    """Example i = (tokens[i*T : i*T+T], tokens[i*T+1 : i*T+T+1])."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = (len(tokens) - 1) // seq_len

    def __len__(self):
        return self.count

    def windows(self, indices) -> np.ndarray:
        """(len(indices), seq_len + 1) tokens: each example's inputs and, shifted by one, targets."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return self.tokens[starts]

    def get(self, indices):
        window = self.windows(indices).astype(np.int32)
        return window[:, :-1], window[:, 1:]


class WindowExamples(TokenExamples):
    """Examples already cut into windows: one worker's shard as a cluster launcher ships it."""

    def __init__(self, windows: np.ndarray):
        self._windows, self.seq_len, self.count = windows, windows.shape[1] - 1, len(windows)

    def windows(self, indices) -> np.ndarray:
        return self._windows[np.asarray(indices, dtype=np.int64)]


class ArrayExamples:
    """Examples given as arrays of inputs and targets, split along the first axis."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray):
        if len(inputs) != len(targets):
            raise ConfigError(f"{len(inputs)} inputs but {len(targets)} targets; give one target per input")
        self.inputs, self.targets = inputs, targets

    def __len__(self):
        return len(self.targets)

    def get(self, indices):
        idx = np.asarray(indices)
        return self.inputs[idx], self.targets[idx]


class BatchStream:
    """Training batches given one by one (an iterable of (x, y)): at each step, worker w of N
    takes the w-th of the next N batches. The cursor is the number of steps taken; a resumed run
    iterates again from the start and skips them, so an exact resume needs a re-iterable (a list)."""

    def __init__(self, batches):
        self.batches, self.steps, self._it = batches, 0, None

    def next(self, workers: list, num_workers: int) -> list:
        if self._it is None:
            self._it = iter(self.batches)
            for _ in range(self.steps * num_workers):
                next(self._it)
        try:
            taken = [next(self._it) for _ in range(num_workers)]
        except StopIteration:
            raise ConfigError(f"the training batches ran out after {self.steps} steps of {num_workers} workers; "
                              "give more batches or fewer steps") from None
        self.steps += 1
        return [tuple(np.asarray(a) for a in taken[w]) for w in workers]

    def state(self) -> dict:
        return {"steps": self.steps}

    def load_state(self, state: dict):
        self.steps, self._it = int(state["steps"]), None


class Dataset:
    """Train and validation examples, plus the tokenizer folder for text. `is_shard`: the train
    examples are one worker's shard already (shipped to a cluster worker), not the whole corpus.
    `masked_targets`: some targets are jsonl.IGNORE (padding, prompts), which the loss leaves out."""

    def __init__(self, train, val, tokenizer_dir=None, vocab_size=None, is_shard=False, masked_targets=False):
        self.train, self.val = train, val
        self.tokenizer_dir, self.vocab_size, self.is_shard = tokenizer_dir, vocab_size, is_shard
        self.masked_targets = masked_targets

    def tokens_per_example(self):
        """Tokens in one example: a text window's length, or the length of an integer sequence
        given as arrays (N, T); None for other examples (images, features): they are counted
        as examples, not tokens."""
        if isinstance(self.val, TokenExamples):
            return self.val.seq_len
        inputs = getattr(self.val, "inputs", None)
        if inputs is not None and inputs.ndim == 2 and np.issubdtype(inputs.dtype, np.integer):
            return inputs.shape[1]
        return None

    def eval_batches(self, batch_size: int, sequences: int):
        """The first `sequences` examples of the held-out split (all of it, if it holds fewer), in
        batches of `batch_size` (the last one may be smaller): the same examples whatever the batch size."""
        n = min(sequences, len(self.val))
        return [self.val.get(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def prepare_text(source: str, seq_len: int, vocab_size: int, tokenizer: str = "", log=print) -> Dataset:
    """Tokenize `source` once (cached by content), and split off the last 5% for validation."""
    text = load_text(source, log)
    spec = f"bpe-{vocab_size}" if not tokenizer else f"tok-{Path(tokenizer).resolve()}"
    key = hashlib.sha256(text.encode() + spec.encode()).hexdigest()[:16]
    folder = cache_root() / "text" / key
    tokens_file = folder / "tokens.npy"
    if not tokens_file.exists():
        log(f"tokenizing {source} ({len(text) / 1e6:.1f} MB) into {folder}")
        folder.mkdir(parents=True, exist_ok=True)
        tok_dir = folder / "tokenizer"
        if tokenizer:
            if not Path(tokenizer).is_dir():
                raise ConfigError(f"tokenizer folder {tokenizer} does not exist; pass an HF/mlx-lm tokenizer folder")
            tok_dir = Path(tokenizer).resolve()
        else:
            train_bpe(text, vocab_size, tok_dir)
        tok = Tokenizer(tok_dir)
        tokens = tok.encode_corpus(text)
        dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
        buf = io.BytesIO()
        np.save(buf, tokens.astype(dtype))
        (folder / "meta.json").write_text(json.dumps({"tokenizer": str(tok_dir), "vocab_size": tok.vocab_size,
                                                      "tokens": int(len(tokens)), "source": source}))
        atomic_write_bytes(tokens_file, buf.getvalue())  # written last: its presence marks a complete cache
    meta = json.loads((folder / "meta.json").read_text())
    tokens = np.load(tokens_file, mmap_mode="r")
    n_val = max(int(len(tokens) * VAL_FRACTION), seq_len + 1)
    need = n_val + 4 * (seq_len + 1)
    if len(tokens) < need:
        chars_per_token = len(text) / max(len(tokens), 1)
        raise ConfigError(f"data {source} has {len(tokens)} tokens, too few for seq-len {seq_len}: give at least "
                          f"{need} tokens (about {need * chars_per_token / 1e3:.0f} kB of text) or a smaller --seq-len")
    train = TokenExamples(tokens[:-n_val], seq_len)
    val = TokenExamples(tokens[-n_val:], seq_len)
    return Dataset(train, val, Path(meta["tokenizer"]), meta["vocab_size"])


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def fashion_mnist_places() -> list:
    """Where Fashion-MNIST's four .gz files are looked for, in order: $MLX_DILOCO_FASHION_MNIST,
    our cache, where Keras and torchvision keep them, and Debian's package."""
    env = os.environ.get("MLX_DILOCO_FASHION_MNIST")
    home = Path.home()
    return [Path(p) for p in ([env] if env else [])] + [
        cache_root() / "fashion-mnist", home / ".keras" / "datasets" / "fashion-mnist",
        home / "data" / "FashionMNIST" / "raw", Path("/usr/share/datasets/fashion-mnist")]


def is_fashion_mnist_folder(folder: Path) -> bool:
    return all((Path(folder) / name).is_file() for name in FASHION_MNIST_FILES)


def find_fashion_mnist() -> Path:
    for folder in fashion_mnist_places():
        if is_fashion_mnist_folder(folder):
            return folder
    raise ConfigError(
        f"Fashion-MNIST not found (looked in {', '.join(str(p) for p in fashion_mnist_places())}); put its four "
        f"*-ubyte.gz files ({FASHION_MNIST_URL}) in {cache_root() / 'fashion-mnist'} or pass --data FOLDER "
        "(Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist)")


def prepare_fashion_mnist(folder: Path) -> Dataset:
    """Fashion-MNIST from a folder of its four .gz files (`data: fashion-mnist` finds one)."""
    def split(prefix):
        images = _read_idx(folder / f"{prefix}-images-idx3-ubyte.gz").astype(np.float32) / 255.0
        labels = _read_idx(folder / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int32)
        return ArrayExamples(images[..., None], labels)
    return Dataset(split("train"), split("t10k"))


# ---------------------------------------------------------------- shards shipped to cluster workers

# The files of a tokenizer folder that a shard carries: what mlx-lm's load_tokenizer reads of a model
# folder (mlx_lm.utils' download patterns, less *.py: no code travels), not the model's weights.
TOKENIZER_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")


def write_shard(data: Dataset, worker: int, num_workers: int, folder: Path) -> Path:
    """Write worker `worker`'s shard (its train examples, in shard order), the held-out split, the
    tokenizer and what the run needs to know of them (masked targets) into `folder`: everything a
    cluster worker needs, so the corpus stays on the launcher. Text ships as windows of tokens; examples
    given as arrays (JSONL's padded inputs and targets, Fashion-MNIST, .npz) as those arrays."""
    if not isinstance(data.train, (TokenExamples, ArrayExamples)):
        raise ConfigError(f"{type(data.train).__name__} examples cannot be cut into shards for the workers; "
                          "put the data on every machine and pass --data-on-workers")
    ids = shard_indices(len(data.train), worker, num_workers)
    if isinstance(data.train, TokenExamples):
        arrays = {"train": data.train.windows(ids), "val": data.val.windows(range(len(data.val)))}
    else:
        (x, y), (val_x, val_y) = data.train.get(ids), data.val.get(np.arange(len(data.val)))
        arrays = {"train_inputs": x, "train_targets": y, "val_inputs": val_x, "val_targets": val_y}
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", np.ascontiguousarray(array))
    if data.tokenizer_dir:  # (a model folder's tokenizer: its files, not the model's weights)
        (folder / "tokenizer").mkdir(exist_ok=True)
        for path in Path(data.tokenizer_dir).iterdir():
            if path.is_file() and any(path.match(pattern) for pattern in TOKENIZER_FILES):
                shutil.copy2(path, folder / "tokenizer" / path.name)
    (folder / "meta.json").write_text(json.dumps({"worker": worker, "num_workers": num_workers,
                                                  "vocab_size": data.vocab_size,
                                                  "masked_targets": data.masked_targets}))
    return folder


def read_shard_meta(folder: Path) -> dict:
    """A shard's meta.json (what write_shard, or data/post_training.py's, says of it)."""
    if not (Path(folder) / "meta.json").exists():
        raise ConfigError(f"{folder} is not a shard folder (no meta.json)")
    return json.loads((Path(folder) / "meta.json").read_text())


def load_shard(folder: Path) -> Dataset:
    """The shard write_shard wrote into `folder`, its examples memory-mapped."""
    folder = Path(folder)
    meta = read_shard_meta(folder)
    load = lambda name: np.load(folder / f"{name}.npy", mmap_mode="r")
    if (folder / "train.npy").exists():
        train, val = WindowExamples(load("train")), WindowExamples(load("val"))
    else:
        train = ArrayExamples(load("train_inputs"), load("train_targets"))
        val = ArrayExamples(load("val_inputs"), load("val_targets"))
    tokenizer = folder / "tokenizer" if (folder / "tokenizer").is_dir() else None
    return Dataset(train, val, tokenizer, meta["vocab_size"], is_shard=True,
                   masked_targets=meta.get("masked_targets", False))


def prepare_arrays(path: Path) -> Dataset:
    """Examples saved as arrays (`np.savez`): train_inputs, train_targets, and optionally
    eval_inputs, eval_targets (else the training examples are evaluated)."""
    if not Path(path).is_file():
        raise ConfigError(f"data file {path} does not exist")
    arrays = np.load(path)
    missing = {"train_inputs", "train_targets"} - set(arrays.files)
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(sorted(missing))}; save it with "
                          "np.savez(path, train_inputs=X, train_targets=Y, eval_inputs=..., eval_targets=...)")
    split = "eval" if "eval_inputs" in arrays.files else "train"
    return Dataset(ArrayExamples(arrays["train_inputs"], arrays["train_targets"]),
                   ArrayExamples(arrays[f"{split}_inputs"], arrays[f"{split}_targets"]))


def prepare_jsonl(source: str, seq_len: int, tokenizer: str, mask_prompt: bool, log=print) -> Dataset:
    """mlx-lm's fine-tuning data (data/jsonl.py): whole examples, padded, the targets the loss
    leaves out masked; test.jsonl's, if there is one, kept as `test`."""
    splits, vocab_size = load_jsonl(source, seq_len, tokenizer, mask_prompt, VAL_FRACTION, log)
    data = Dataset(ArrayExamples(*splits["train"]), ArrayExamples(*splits["valid"]), Path(tokenizer), vocab_size,
                   masked_targets=True)
    data.test = ArrayExamples(*splits["test"]) if "test" in splits else None
    return data


def prepare(source: str, seq_len: int, vocab_size: int, tokenizer: str = "", log=print,
            mask_prompt: bool = False) -> Dataset:
    if is_jsonl(source):  # mlx-lm's fine-tuning formats
        return prepare_jsonl(source, seq_len, tokenizer, mask_prompt, log)
    if mask_prompt:
        raise ConfigError(f"mask-prompt needs prompts to mask, and data {source} is not JSONL; give a .jsonl "
                          "file or a folder with train.jsonl, or drop --mask-prompt")
    if source == FASHION_MNIST:
        return prepare_fashion_mnist(find_fashion_mnist())
    if is_fashion_mnist_folder(source):
        return prepare_fashion_mnist(Path(source))
    if source.endswith(".npz"):
        return prepare_arrays(Path(source))
    return prepare_text(source, seq_len, vocab_size, tokenizer, log=log)


# ---------------------------------------------------------------- sampling

def shard_indices(num_examples: int, worker: int, num_workers: int) -> np.ndarray:
    return np.arange(worker, num_examples, num_workers)


def oversized_batch(batch_size: int, samplers: list) -> str:
    """A line saying so when a batch is larger than a worker's shard (every batch repeats
    examples, and an epoch is shorter than a step), else ''."""
    shard = min((len(s.shard) for s in samplers if isinstance(s, ShardSampler)), default=None)
    if shard is None or batch_size <= shard:
        return ""
    return (f"note: batch size {batch_size} is larger than a worker's share of the training data ({shard} "
            f"example{'s' * (shard > 1)}): every batch repeats examples; give more data, fewer workers or a "
            f"batch size of {shard} or less")


class ShardSampler:
    """Worker `worker` of `num_workers` reads a disjoint shard: every num_workers-th example,
    in a fresh seeded permutation each epoch. Interleaved rather than contiguous, so that every
    shard has the same distribution (a contiguous quarter of Shakespeare is a different set of
    plays). The cursor (epoch, pos) is the whole state."""

    def __init__(self, num_examples: int, worker: int, num_workers: int, seed: int, is_shard: bool = False):
        # is_shard: the examples are this worker's shard already (same order, same permutations)
        self.shard = np.arange(num_examples) if is_shard else shard_indices(num_examples, worker, num_workers)
        if len(self.shard) < 1:
            raise ConfigError(f"{num_workers} workers leave worker {worker} no data; use fewer workers or more data")
        self.worker, self.seed = worker, seed
        self.epoch, self.pos = 0, 0
        self._order = None

    def _permutation(self):
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.worker, self.epoch])
            self._order = rng.permutation(self.shard)
        return self._order

    def next_indices(self, batch_size: int) -> np.ndarray:
        out = []
        while len(out) < batch_size:
            order = self._permutation()
            take = order[self.pos:self.pos + batch_size - len(out)]
            out.extend(take.tolist())
            self.pos += len(take)
            if self.pos >= len(order):
                self.epoch, self.pos, self._order = self.epoch + 1, 0, None
        return np.array(out)

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def seek(self, examples: int):
        """Where the cursor is after `examples` examples drawn from the start (a joiner takes over a
        shard where the worker that left it stopped)."""
        epoch, pos = divmod(examples, len(self.shard))
        self.load_state({"epoch": epoch, "pos": pos})

    def load_state(self, state: dict):
        self.epoch, self.pos, self._order = int(state["epoch"]), int(state["pos"]), None
