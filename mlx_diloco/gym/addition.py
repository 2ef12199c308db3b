"""The addition task: a verifiable problem small enough for a CPU, for the post-training gym problems.

Everything is made here, deterministically from a seed, into a folder (by default the cache's
`addition/`): a character tokenizer (digits, '+', '=' and the end of text) with a chat template that
writes a prompt as it is and ends a reply with the end of text; the data in three forms, the same
sums in each split, train's and valid's disjoint,

    sft/   {"prompt": "123+45=", "completion": "168"}      (SFT: mlx-lm's prompt/completion records)
    grpo/  {"prompt": "123+45=", "answer": "168"}          (GRPO: the exact answer is the reward)
    dpo/   {"prompt": "123+45=", "chosen": "168", "rejected": "178"}   (a digit of the sum off by one)

and the SFT start: a tiny Llama (hidden 64, 2 blocks, this vocabulary) trained from scratch on sft/
with the prompt masked, stopped partway (it writes sums, and gets many wrong), then exported as an
mlx-lm model folder: the base the GRPO and DPO problems put adapters on.
"""

import json
import shutil
from pathlib import Path

import numpy as np

from ..data.datasets import cache_root

EOS = "<|endoftext|>"
CHARACTERS = list("0123456789+=")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}" + EOS +
                 "{% endif %}{% endfor %}")
LOW, HIGH = 10, 1000  # terms of two or three digits
TRAIN, VALID = 20000, 500
MODEL = {"type": "llama", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 32, "tie_word_embeddings": False}
# One worker, a schedule of 1,200 steps (which ends at 87% held out), stopped at step 800: a start
# that writes sums but gets many wrong, so that GRPO and DPO have room.
SFT = dict(workers=1, strategy="ddp", steps=1200, batch_size=64, lr=3e-3, warmup=50, weight_decay=0.0,
           mask_prompt=True, seq_len=16, eval_every=100, eval_sequences=256)
SFT_STOP = 800


def write_tokenizer(folder: Path) -> Path:
    """A tokenizer of one token per character, in Hugging Face's format (what mlx-lm loads)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {EOS: 0, **{c: i + 1 for i, c in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([EOS])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "chat_template": CHAT_TEMPLATE}))
    return folder


def sums(count: int, rng, exclude=frozenset()) -> list:
    """`count` distinct (a, b) pairs of two- or three-digit terms, none of `exclude`."""
    pairs, seen = [], set(exclude)
    while len(pairs) < count:
        a, b = (int(v) for v in rng.integers(LOW, HIGH, 2))
        if (a, b) not in seen:
            seen.add((a, b))
            pairs.append((a, b))
    return pairs


def wrong_sum(a: int, b: int, rng) -> str:
    """The sum with one digit off by one (rejected: a near miss, the kind of error the model makes)."""
    digits = list(str(a + b))
    i = int(rng.integers(len(digits)))
    d = int(digits[i])
    digits[i] = str(d + 1 if d < 9 and (d == 0 or rng.random() < 0.5) else d - 1)
    wrong = "".join(digits).lstrip("0") or "0"
    return wrong if wrong != str(a + b) else str(a + b + 1)


def write_data(folder: Path, seed: int = 0, train: int = TRAIN, valid: int = VALID) -> Path:
    """sft/, grpo/ and dpo/, each with train.jsonl and valid.jsonl, of the same sums."""
    rng = np.random.default_rng(seed)
    splits = {"valid": sums(valid, rng)}
    splits["train"] = sums(train, rng, exclude=frozenset(splits["valid"]))
    forms = {"sft": lambda a, b: {"prompt": f"{a}+{b}=", "completion": str(a + b)},
             "grpo": lambda a, b: {"prompt": f"{a}+{b}=", "answer": str(a + b)},
             "dpo": lambda a, b: {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": wrong_sum(a, b, rng)}}
    for form, record in forms.items():
        (folder / form).mkdir(parents=True, exist_ok=True)
        for split, pairs in splits.items():
            (folder / form / f"{split}.jsonl").write_text("".join(json.dumps(record(a, b)) + "\n" for a, b in pairs))
    return folder


def prepare(folder: Path = None, log=print) -> Path:
    """The task's folder, made once (tokenizer/, data, sft-model/: the SFT start, an mlx-lm folder)."""
    from ..config import TrainConfig
    from ..tools.export import export_mlx_lm
    from ..exchange.comm import SimCommunicator
    from ..training.run import Run
    folder = Path(folder or cache_root() / "addition")
    if (folder / "sft-model" / "config.json").is_file():
        return folder
    write_data(folder)
    write_tokenizer(folder / "tokenizer")
    (folder / "model.json").write_text(json.dumps(MODEL))
    run = folder / "sft-run"
    shutil.rmtree(run, ignore_errors=True)
    log(f"the addition task's SFT start: a tiny Llama trained on {folder / 'sft'} ({SFT_STOP} steps)")
    config = TrainConfig.from_dict({**SFT, "model": str(folder / "model.json"), "data": str(folder / "sft"),
                                    "tokenizer": str(folder / "tokenizer")})
    Run(config, run, SimCommunicator(1), log=log).train(stop_after=SFT_STOP)
    export_mlx_lm(run, folder / "sft-model.tmp")
    (folder / "sft-model.tmp").rename(folder / "sft-model")  # last: its presence marks the task made
    return folder
