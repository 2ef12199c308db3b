"""Post-training data (objectives/): preference pairs for DPO and ORPO, prompts with answers for GRPO,
in mlx-lm-lora's JSONL field names, a folder's train.jsonl and valid.jsonl (or one file, its end held out):

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}            DPO, ORPO (an optional "system")
    {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], "rejected": [...]}
    {"chosen": [user, assistant], "rejected": [user, assistant]}   the prompt: the two's shared start (TRL)
    {"chosen": {"messages": [...]}, ...}                          mlx-lm-lora's ORPO form
    {"prompt": "2+2=", "answer": "4"}                              GRPO (the answer goes to the rewards)

Tokenized as TRL's tokenize_fn does: the prompt through the tokenizer's chat template with the
generation prompt, the completion the tokens the template writes after it (its end-of-turn included);
without a template, the prompt's text and the completion's, then EOS. A sequence is its prompt and its
completion; its targets are IGNORE on the prompt and the padding (data/jsonl.py's padded_arrays), so a
loss sums the completion's log-probabilities alone. Every bad line is one ConfigError naming the file,
the line and the fix; nothing is cut short.
"""

import json
from pathlib import Path

import numpy as np

from ..objectives.kinds import kind
from ..options import ConfigError, shown
from .datasets import VAL_FRACTION, ArrayExamples, Dataset, read_shard_meta, shard_indices
from .jsonl import padded_arrays, read_records, split_files

PAIR_FORMAT = '{"prompt": ..., "chosen": ..., "rejected": ...}'
PROMPT_FORMAT = '{"prompt": ..., "answer": ...}'


class Renderer:
    """Messages as token ids, through the tokenizer's chat template where it has one."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chat = tokenizer, tokenizer.has_chat_template

    def text(self, messages: list, generation_prompt: bool) -> list:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)  # as mlx_lm.generate: the template wrote them

    def prompt(self, messages: list) -> list:
        if self.chat:
            return self.text(messages, generation_prompt=True)
        return self.tokenizer.encode("".join(m["content"] for m in messages))

    def completion(self, messages: list, reply: list) -> list:
        """The tokens of `reply` (assistant messages) after the prompt `messages`."""
        if not self.chat:
            return self.tokenizer.encode("".join(m["content"] for m in reply), add_special_tokens=False) + [
                self.tokenizer.eos_token_id]
        prompt, whole = self.prompt(messages), self.text(messages + reply, generation_prompt=False)
        if whole[:len(prompt)] != prompt:  # a template whose reply re-renders the prompt: the tokens after it
            raise ValueError("the chat template writes the prompt differently once a reply follows it")
        return whole[len(prompt):]


class Line:
    """One record of a JSONL file, and its errors, each naming the file and the line."""

    def __init__(self, path: Path, number: int, record: dict, form: str):
        self.path, self.number, self.record, self.form = path, number, record, form

    def error(self, problem: str) -> ConfigError:
        return ConfigError(f"{self.path} line {self.number}: {problem}")

    def messages(self, key: str, role: str = "user") -> list:
        """Field `key` as chat messages: a string is one message of `role`; a list of messages, or
        mlx-lm-lora's {"messages": [...]}, as they are."""
        if key not in self.record:
            hint = " (a {\"messages\"} record is SFT data: train it with --objective sft)" \
                if "messages" in self.record and "prompt" not in self.record else ""
            raise self.error(f"missing \"{key}\"; write each line as {self.form}{hint}")
        value = self.record[key]
        if isinstance(value, dict) and "messages" in value:
            value = value["messages"]
        if isinstance(value, str):
            if not value.strip():
                raise self.error(f"\"{key}\" is empty; give it text")
            return [{"role": role, "content": value}]
        if not (isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)):
            raise self.error(f"\"{key}\" must be a string or a list of messages "
                             f"[{{\"role\": ..., \"content\": ...}}], not {shown(value)}")
        return value

    def prompt(self) -> list:
        messages = self.messages("prompt")
        system = self.record.get("system")
        if system is not None and not isinstance(system, str):
            raise self.error(f"\"system\" must be a string, not {shown(system)}")
        return ([{"role": "system", "content": system}] if system else []) + messages


def reply_after(line: Line, prompt: list, key: str) -> list:
    """The assistant messages of field `key`, without the prompt where the field repeats it (TRL's
    conversational form); one that is empty is refused."""
    reply = line.messages(key, role="assistant")
    if reply[:len(prompt)] == prompt:
        reply = reply[len(prompt):]
    if not reply or not any(m["content"].strip() for m in reply):
        raise line.error(f"\"{key}\" is empty; give the completion's text")
    return reply


def pair_prompt(line: Line) -> list:
    """The prompt's messages: its own field, or (none) the messages chosen and rejected share (TRL)."""
    if "prompt" in line.record:
        return line.prompt()
    chosen, rejected = line.messages("chosen"), line.messages("rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if not shared:
        raise line.error(f"missing \"prompt\"; write each line as {PAIR_FORMAT}")
    return chosen[:shared]


def tokens(line: Line, render, *args) -> list:
    """`render(*args)`'s ids; an error of the template or the tokenizer names the line."""
    try:
        return render(*args)
    except Exception as e:  # the user's record through the template or the tokenizer
        raise line.error(f"could not be tokenized ({type(e).__name__}: {str(e)[:100]})") from None


def check_text_or_chat(line: Line, renderer: Renderer, prompt: list):
    if not renderer.chat and (len(prompt) > 1 or prompt[0]["role"] != "user"):
        raise line.error("chat messages need a chat template, and the tokenizer has none; use an instruct "
                         "model's folder, or give the prompt as a string")


def check_prompt_length(line: Line, prompt_ids: list, seq_len: int, room: int, why: str):
    if len(prompt_ids) + room - 1 > seq_len:
        raise line.error(f"the prompt is {len(prompt_ids)} tokens, {why} seq-len {seq_len}; shorten it or "
                         "raise --seq-len")


def read_pairs(path: Path, renderer: Renderer, seq_len: int) -> list:
    """[(prompt ids, chosen ids, rejected ids)] of a preference file."""
    pairs = []
    for number, record in read_records(path, PAIR_FORMAT):
        line = Line(path, number, record, PAIR_FORMAT)
        prompt = pair_prompt(line)
        check_text_or_chat(line, renderer, prompt)
        prompt_ids = tokens(line, renderer.prompt, prompt)
        check_prompt_length(line, prompt_ids, seq_len, 2, "leaving no room for a completion in")
        replies = {}
        for key in ("chosen", "rejected"):
            replies[key] = tokens(line, renderer.completion, prompt, reply_after(line, prompt, key))
            if len(prompt_ids) + len(replies[key]) - 1 > seq_len:
                raise line.error(f"the prompt and \"{key}\" are {len(prompt_ids) + len(replies[key])} tokens, more "
                                 f"than seq-len {seq_len} + 1; shorten them or raise --seq-len")
        pairs.append((prompt_ids, replies["chosen"], replies["rejected"]))
    return pairs


def read_prompts(path: Path, renderer: Renderer, seq_len: int, max_completion: int) -> list:
    """[(prompt ids, prompt as given, answer, answer's completion ids)] of a GRPO file."""
    prompts = []
    for number, record in read_records(path, PROMPT_FORMAT):
        line = Line(path, number, record, PROMPT_FORMAT)
        prompt = line.prompt()
        check_text_or_chat(line, renderer, prompt)
        if "answer" not in record:
            raise line.error(f"missing \"answer\" (what the rewards check a completion against); write each "
                             f"line as {PROMPT_FORMAT}")
        answer = record["answer"]
        if not isinstance(answer, str):
            raise line.error(f"\"answer\" must be a string, not {shown(answer)}; write it in quotes, e.g. "
                             f"\"answer\": \"{answer}\"")
        prompt_ids = tokens(line, renderer.prompt, prompt)
        check_prompt_length(line, prompt_ids, seq_len, max_completion, f"and max-completion-length {max_completion} "
                                                                        "exceed")
        answer_ids = tokens(line, renderer.completion, prompt, [{"role": "assistant", "content": answer}])
        if len(answer_ids) > max_completion:
            raise line.error(f"the answer is {len(answer_ids)} tokens, more than max-completion-length "
                             f"{max_completion}: no completion could match it; raise --max-completion-length")
        prompts.append((prompt_ids, record["prompt"], answer, answer_ids))
    return prompts


class PairExamples:
    """Preference pairs: example i is its chosen and its rejected sequence, each (inputs, targets) padded
    to one width. A batch of B pairs is (inputs, targets) of 2B rows, the B chosen ones first (TRL's
    concatenated forward)."""

    def __init__(self, chosen: tuple, rejected: tuple):
        self.chosen, self.rejected, self.count = chosen, rejected, len(chosen[0])

    @classmethod
    def of(cls, pairs: list, width: int) -> "PairExamples":
        """[(prompt ids, chosen ids, rejected ids)] as padded arrays."""
        return cls(padded_arrays([(p + c, len(p)) for p, c, _ in pairs], width),
                   padded_arrays([(p + r, len(p)) for p, _, r in pairs], width))

    def __len__(self):
        return self.count

    def get(self, indices):
        idx = np.asarray(indices)
        return tuple(np.concatenate([c[idx], r[idx]]) for c, r in zip(self.chosen, self.rejected))

    def arrays(self, indices) -> dict:
        """Examples `indices` as the arrays a shard keeps (`from_arrays` reads them back)."""
        idx = np.asarray(indices, np.int64)
        return {f"{side}_{part}": array[idx] for side, pair in (("chosen", self.chosen), ("rejected", self.rejected))
                for part, array in zip(("inputs", "targets"), pair)}

    @classmethod
    def from_arrays(cls, arrays: dict) -> "PairExamples":
        return cls(*((arrays[f"{side}_inputs"], arrays[f"{side}_targets"]) for side in ("chosen", "rejected")))


class PromptExamples:
    """GRPO's prompts: a batch is (the prompts' ids, right-padded, and the examples' indices), which
    the rollouts look up (objectives/grpo.py)."""

    def __init__(self, prompts: list, width: int = None):
        """`prompts`: [(prompt ids, prompt as given, answer, ...)]; `width`: the padded prompts' (default:
        the longest prompt's; a shard keeps its whole data's, so that its batches are sim's)."""
        self.ids = [list(p) for p, _, _, *_ in prompts]
        self.prompts = [prompt for _, prompt, _, *_ in prompts]
        self.answers = [answer for _, _, answer, *_ in prompts]
        self.width = width or max(len(p) for p in self.ids)
        self.padded = np.zeros((len(self.ids), self.width), np.int32)
        for row, ids in zip(self.padded, self.ids):
            row[:len(ids)] = ids

    def __len__(self):
        return len(self.ids)

    def get(self, indices):
        idx = np.asarray(indices, np.int32)
        return self.padded[idx], idx

    def records(self, indices) -> list:
        """Examples `indices` as a shard keeps them (JSON: a prompt may be messages): [[ids, prompt, answer]]."""
        return [[self.ids[i], self.prompts[i], self.answers[i]] for i in indices]


class PostTrainingData(Dataset):
    """A post-training objective's data: train examples as pairs or prompts; held out, `val` (pairs,
    or each prompt with its answer as the completion: what the eval loss scores) and, for GRPO, the
    held-out prompts the greedy accuracy is measured on. `tokenizer`: mlx-lm's, for the rollouts."""

    def __init__(self, train, val, tokenizer_dir, tokenizer, held_out=None, is_shard=False):
        super().__init__(train, val, Path(tokenizer_dir), len(tokenizer.vocab), is_shard=is_shard)
        self.tokenizer, self.held_out = tokenizer, held_out

    def tokens_per_example(self):
        """None: an example is a pair or a prompt (the objective counts the tokens it trains)."""
        return None


def held_out(train: list, files: dict, log) -> tuple:
    """(train, valid) records: valid.jsonl's, or the last VAL_FRACTION of train's."""
    held = max(1, int(len(train) * VAL_FRACTION))
    if len(train) <= held:
        raise ConfigError(f"{files['train']} holds {len(train)} example(s): too few to hold some out for "
                          "validation; give more, or a valid.jsonl beside it")
    log(f"no valid.jsonl beside {files['train']}: its last {held} examples are held out for validation")
    return train[:-held], train[-held:]


def load_post_training(objective: str, source: str, tokenizer_dir: str, seq_len: int, max_completion: int,
                       log=print) -> PostTrainingData:
    """The data of objective dpo, orpo (pairs) or grpo (prompts), read and checked whole."""
    from mlx_lm.utils import load_tokenizer
    prompts = kind(objective).data == "prompts"  # (objectives/kinds.py: what each objective trains on)
    if not tokenizer_dir:
        raise ConfigError(f"{objective} data {source} needs the model's tokenizer: pass --model a model folder "
                          "(or --tokenizer FOLDER)")
    if Path(source).suffix != ".jsonl" and not (Path(source) / "train.jsonl").is_file():
        form = PROMPT_FORMAT if prompts else PAIR_FORMAT
        raise ConfigError(f"objective {objective} reads JSONL: pass --data a .jsonl file or a folder with train.jsonl "
                          f"(and valid.jsonl), each line {form}")
    tokenizer = load_tokenizer(Path(tokenizer_dir))
    renderer = Renderer(tokenizer)
    files = split_files(Path(source))
    if prompts:
        read = lambda path: read_prompts(path, renderer, seq_len, max_completion)  # noqa: E731
    else:
        read = lambda path: read_pairs(path, renderer, seq_len)  # noqa: E731
    train = read(files["train"])
    train, valid = (train, read(files["valid"])) if "valid" in files else held_out(train, files, log)
    if not prompts:
        width = max(len(p) + max(len(c), len(r)) for p, c, r in train + valid) - 1
        return PostTrainingData(PairExamples.of(train, width), PairExamples.of(valid, width), tokenizer_dir, tokenizer)
    # held out: each prompt with its answer as the completion (the eval loss: the answer's NLL)
    width = max(len(p) for p, _, _, _ in train + valid) + max_completion - 1
    answers = ArrayExamples(*padded_arrays([(p + a, len(p)) for p, _, _, a in valid], width))
    return PostTrainingData(PromptExamples(train), answers, tokenizer_dir, tokenizer, held_out=PromptExamples(valid))


# ---------------------------------------------------------------- shards shipped to cluster workers

def write_post_training_shard(data: PostTrainingData, worker: int, num_workers: int, folder: Path) -> Path:
    """Worker `worker`'s shard of post-training data, as datasets.write_shard cuts text and arrays: its
    train examples in shard order (pairs as their padded arrays; prompts with their answers, and the
    width sim pads them to), and the whole held-out split (pairs; GRPO's prompts and their answers as
    completions): the first eval-sequences of it are every run's. No tokenizer: a worker loads its
    model, tokenizer included, from its own disk."""
    ids = shard_indices(len(data.train), worker, num_workers)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"worker": worker, "num_workers": num_workers, "examples": "pairs"}
    if isinstance(data.train, PairExamples):
        arrays = {**{f"train_{k}": v for k, v in data.train.arrays(ids).items()},
                  **{f"val_{k}": v for k, v in data.val.arrays(range(len(data.val))).items()}}
    else:
        meta.update(examples="prompts", width=data.train.width)
        arrays = dict(zip(("val_inputs", "val_targets"), data.val.get(np.arange(len(data.val)))))
        (folder / "prompts.json").write_text(json.dumps({"train": data.train.records(ids),
                                                         "held_out": data.held_out.records(range(len(data.held_out)))}))
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", np.ascontiguousarray(array))
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def load_post_training_shard(folder: Path, tokenizer_dir: str) -> PostTrainingData:
    """The shard write_post_training_shard wrote into `folder`, read with the tokenizer of the model
    this worker loads (`tokenizer_dir`)."""
    from mlx_lm.utils import load_tokenizer
    folder = Path(folder)
    meta = read_shard_meta(folder)
    arrays = {p.stem: np.load(p) for p in folder.glob("*.npy")}
    tokenizer = load_tokenizer(Path(tokenizer_dir))
    if meta.get("examples") == "pairs":
        pairs = lambda split: PairExamples.from_arrays(  # noqa: E731
            {k.removeprefix(f"{split}_"): v for k, v in arrays.items() if k.startswith(f"{split}_")})
        return PostTrainingData(pairs("train"), pairs("val"), tokenizer_dir, tokenizer, is_shard=True)
    prompts = json.loads((folder / "prompts.json").read_text())
    answers = ArrayExamples(arrays["val_inputs"], arrays["val_targets"])
    return PostTrainingData(PromptExamples(prompts["train"], meta["width"]), answers, tokenizer_dir, tokenizer,
                            held_out=PromptExamples(prompts["held_out"]), is_shard=True)
