"""Fine-tuning data in mlx-lm's formats: a folder of train.jsonl, valid.jsonl (and test.jsonl), or
one .jsonl file, each line a record {"text"}, {"messages"} (chat, through the tokenizer's chat
template, with "tools" where the template has them) or {"prompt", "completion"}.

Records are tokenized by mlx-lm's own dataset classes (mlx_lm.tuner.datasets), which give each
example's tokens and the offset where its completion starts (0 unless mask-prompt). The examples are
padded as mlx-lm's iterate_batches pads them (zeros after the end), into arrays of inputs and
targets; the targets the loss leaves out (the padding, and the prompt under mask-prompt) are IGNORE,
so a batch is still a pair (x, y) and the loss is training/workers.py's masked_cross_entropy.
Nothing is cached: the data is read and checked whole before anything is written.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..options import ConfigError
from .hf_tokenizer import hf_tokenizer

IGNORE = -1  # a target the loss leaves out
SPLITS = ("train", "valid", "test")
PAD_TO = 32  # the inputs' width is a multiple of this (mlx-lm's iterate_batches), at most seq-len
FORMATS = ('{"text": ...}, {"messages": [{"role": ..., "content": ...}, ...]} or '
           '{"prompt": ..., "completion": ...}')


def is_jsonl(source: str) -> bool:
    """A .jsonl file, or a folder with a train.jsonl."""
    path = Path(source)
    return path.suffix == ".jsonl" or (path / "train.jsonl").is_file()


def read_records(path: Path, formats: str = FORMATS) -> list:
    """(line number, record) for each non-blank line; a line that is not UTF-8 text or not a JSON
    object is refused, naming the line and the record `formats` the file is read for."""
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = utf8_line(path, number, raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {number} is not JSON ({e.msg}); write one JSON object a line: "
                                  f"{formats}") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path} line {number} is a JSON {type(record).__name__}, not an object; "
                                  f"write one record a line: {formats}")
            records.append((number, record))
    if not records:
        raise ConfigError(f"{path} holds no records; write one a line: {formats}")
    return records


def utf8_line(path: Path, number: int, raw: bytes) -> str:
    """A line of a JSONL file as text: JSON is UTF-8 (a binary file, or text saved as latin-1, is not)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} line {number} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                          f"{e.start + 1}); save the file as UTF-8 (a latin-1 file: iconv -f latin1 -t utf-8 "
                          f"{path.name}), or pass a JSONL file") from None


def format_of(record: dict) -> str:
    """The record's format, tried in the order mlx-lm's create_dataset tries them; '' for none."""
    if "prompt" in record and "completion" in record:
        return "completions"
    return "chat" if "messages" in record else "text" if "text" in record else ""


def text_problem(kind: str, record: dict) -> str:
    """What in a record of `kind` is not the text mlx-lm's templates take, and the fix ('' if nothing):
    a chat message's content of 5 would otherwise train as the characters "5"."""
    if kind == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return ('"messages" is not a list of messages; write it as [{"role": "user", "content": "..."}, '
                    '{"role": "assistant", "content": "..."}]')
        fields = {}
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return f'messages[{i}] is not a {{"role": ..., "content": ...}} object; write it as one'
            if not (message.get("tool_calls") and message.get("content") is None):  # a tool call may have none
                fields[f'messages[{i}]\'s "content"'] = message.get("content")
    else:
        fields = {f'"{k}"': record[k] for k in (("text",) if kind == "text" else ("prompt", "completion"))}
    for name, value in fields.items():
        if not isinstance(value, str):
            return f'{name} is {json.dumps(value)[:40]}, not a string; write it as text ("...")'
    return ""


def tokenize_file(path: Path, tokenizer, mask_prompt: bool) -> list:
    """[(tokens, offset)] of the file's records, by mlx-lm's dataset class for the file's format
    (its first record's); offset: where the trained tokens start (mask-prompt), else 0."""
    from mlx_lm.tuner.datasets import create_dataset
    records = read_records(path)
    first_line, first = records[0]
    kind = format_of(first)
    for number, record in records:
        if format_of(record) != kind or not kind:
            found = f"the keys {', '.join(sorted(record)) or 'none'}"
            expected = f"like line {first_line}'s, a {kind} record" if kind else FORMATS
            raise ConfigError(f"{path} line {number} has {found}; give each line one record {expected}")
        if problem := text_problem(kind, record):
            raise ConfigError(f"{path} line {number}: {problem}")
    if kind != "text" and not tokenizer.has_chat_template:
        raise ConfigError(f"{path} line {first_line}: {kind} records need a chat template, and the tokenizer "
                          f"has none; use an instruct model's folder (whose tokenizer_config.json has a "
                          f"chat_template) or {{\"text\": ...}} records")
    if kind == "text" and mask_prompt:
        raise ConfigError(f"{path} holds {{\"text\"}} records, which have no prompt to mask; give "
                          f"{{\"messages\"}} or {{\"prompt\", \"completion\"}} records, or drop --mask-prompt")
    dataset = create_dataset([record for _, record in records], tokenizer, SimpleNamespace(mask_prompt=mask_prompt))
    examples = []
    for number, record in records:
        try:
            examples.append(dataset.process(record))
        except Exception as e:  # the user's record through the template or the tokenizer: say which line
            raise ConfigError(f"{path} line {number} could not be tokenized ({type(e).__name__}: "
                              f"{str(e)[:100]}); give it the shape {FORMATS}") from None
    return examples


def padded_arrays(examples: list, width: int):
    """Inputs and targets (N, width), int32: each example's tokens padded with zeros after its end
    (mlx-lm's iterate_batches); target k is token k + 1, IGNORE where it is padding or (mask-prompt)
    before the example's offset. mlx-lm's mask also trains one padding target per example (it keeps
    steps <= length); here only real tokens are targets."""
    tokens = np.zeros((len(examples), width + 1), np.int32)
    for row, (ids, _) in zip(tokens, examples):
        row[:len(ids)] = ids
    lengths = np.array([len(ids) for ids, _ in examples])[:, None]
    offsets = np.array([offset for _, offset in examples])[:, None]
    position = np.arange(1, width + 1)  # of each target in its example
    trained = (position >= offsets) & (position < lengths)
    return tokens[:, :-1], np.where(trained, tokens[:, 1:], IGNORE).astype(np.int32)


def truncate(splits: dict, seq_len: int, log) -> dict:
    """Each example cut to seq_len + 1 tokens (seq-len inputs and their targets); how many were cut
    is said once."""
    keep = seq_len + 1
    every = [example for examples in splits.values() for example in examples]
    cut = sum(len(ids) > keep for ids, _ in every)
    emptied = sum(offset >= keep for _, offset in every)  # mask-prompt: the prompt fills the whole cut
    if cut:
        log(f"{cut} of {len(every)} examples are longer than seq-len {seq_len} + 1 tokens and were cut to it"
            f"{f' ({emptied} of them to their prompt alone: they train nothing)' if emptied else ''}; "
            "raise --seq-len or split them to train on their ends")
    return {name: [(list(ids[:keep]), offset) for ids, offset in examples] for name, examples in splits.items()}


def split_files(source: Path) -> dict:
    """{split: file}: a folder's train.jsonl, valid.jsonl and test.jsonl (those there), or one file as train."""
    if source.is_file():
        return {"train": source}
    if not source.exists():
        raise ConfigError(f"data path {source} does not exist; pass a .jsonl file or a folder with train.jsonl")
    return {name: source / f"{name}.jsonl" for name in SPLITS if (source / f"{name}.jsonl").is_file()}


def load_jsonl(source: str, seq_len: int, tokenizer_dir: str, mask_prompt: bool, val_fraction: float, log=print):
    """({split: (inputs, targets)}, the tokenizer's vocabulary size): the examples tokenized by the
    model's tokenizer, padded to one width (the longest example's, rounded up to PAD_TO, at most seq-len:
    every worker's batch has the same shape, and the step compiles once). Without valid.jsonl, the
    last `val_fraction` of train's examples are held out."""
    if not tokenizer_dir:
        raise ConfigError(f"JSONL data {source} needs the model's tokenizer: pass --model a model folder "
                          "(or --tokenizer FOLDER)")
    tokenizer = hf_tokenizer(Path(tokenizer_dir))
    files = split_files(Path(source))
    splits = {name: tokenize_file(path, tokenizer, mask_prompt) for name, path in files.items()}
    if "valid" not in splits:
        train = splits["train"]
        held = max(1, int(len(train) * val_fraction))
        if len(train) <= held:
            raise ConfigError(f"{files['train']} holds {len(train)} example(s): too few to hold some out for "
                              "validation; give more, or a valid.jsonl beside it")
        splits["train"], splits["valid"] = train[:-held], train[-held:]
        log(f"no valid.jsonl beside {files['train']}: its last {held} examples are held out for validation")
    splits = truncate(splits, seq_len, log)
    longest = max(len(ids) for examples in splits.values() for ids, _ in examples)
    width = min(seq_len, -(-max(longest - 1, 1) // PAD_TO) * PAD_TO)
    return {name: padded_arrays(examples, width) for name, examples in splits.items()}, len(tokenizer.vocab)
