"""mlx-lm's fine-tuning data (data/jsonl.py): {"text"}, {"messages"} and {"prompt", "completion"}
records on a tiny llama folder made here, with a chat template; the masked loss against one computed
by hand, whole examples per worker, truncation, and one line for each kind of bad input."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from conftest import run_cli, tiny_llama_folder
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.data.datasets import ShardSampler, load_text, prepare
from mlx_diloco.data.jsonl import FORMATS, IGNORE
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.models.zoo import build_model, load_spec
from mlx_diloco.training.run import Run
from mlx_diloco.training.workers import masked_cross_entropy

QUIET = dict(log=lambda m: None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random two-block llama saved by mlx-lm, its tokenizer trained on Shakespeare, with a chat template."""
    return tiny_llama_folder(tmp_path_factory.mktemp("llama"), corpus=load_text("shakespeare")[:200_000])


LINES = [line for line in load_text("shakespeare").splitlines() if len(line) > 20][:60]


def records(kind: str, n: int = 40, start: int = 0) -> list:
    """n records of a format, from Shakespeare's lines: the question is the line before."""
    pairs = [(f"After '{LINES[i][:20]}'?", LINES[i + 1][:40]) for i in range(start, start + n)]
    if kind == "text":
        return [{"text": f"{q} {a}"} for q, a in pairs]
    if kind == "chat":
        return [{"messages": [{"role": "system", "content": "Recite."}, {"role": "user", "content": q},
                              {"role": "assistant", "content": a}]} for q, a in pairs]
    return [{"prompt": q, "completion": a} for q, a in pairs]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def data_folder(tmp_path, kind: str):
    folder = tmp_path / kind
    write_jsonl(folder / "train.jsonl", records(kind, 40))
    write_jsonl(folder / "valid.jsonl", records(kind, 8, start=40))
    return folder


def hand_loss(model, tokenizer, recs, kind: str, mask_prompt: bool) -> float:
    """The mean cross-entropy over the trained tokens, example by example without padding: every
    token after the first, or (mask-prompt) after the prompt the chat template ends with."""
    total, count = 0.0, 0
    for r in recs:
        messages = r.get("messages") or [{"role": "user", "content": r["prompt"]},
                                         {"role": "assistant", "content": r["completion"]}]
        ids = tokenizer.apply_chat_template(messages, return_dict=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=False)
        first = len(prompt) if mask_prompt else 1
        logits = np.array(model(mx.array(ids[:-1])[None])[0].astype(mx.float32))
        logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total -= sum(logprobs[k - 1, ids[k]] for k in range(first, len(ids)))
        count += len(ids) - first
    return total / count


@pytest.mark.parametrize("kind,mask_prompt", [("chat", True), ("chat", False), ("completions", True),
                                              ("completions", False)])
def test_masked_loss_is_the_loss_over_trained_tokens(tmp_path, model_dir, kind, mask_prompt):
    from mlx_lm.utils import load_tokenizer
    data = prepare(str(data_folder(tmp_path, kind)), 256, 0, str(model_dir), mask_prompt=mask_prompt, **QUIET)
    model = build_model(load_spec(str(model_dir)), seed=0)
    x, y = data.val.get(np.arange(8))
    # The width of the longest example's inputs (97 and 80 tokens) rounded up to 32, not seq-len's.
    assert x.shape[1] == {"chat": 128, "completions": 96}[kind]
    ours = masked_cross_entropy(model, mx.array(x), mx.array(y)).item()
    expected = hand_loss(model, load_tokenizer(model_dir), records(kind, 8, start=40), kind, mask_prompt)
    assert ours == pytest.approx(expected, rel=1e-5)


def test_text_records_train_every_token_after_the_first(tmp_path, model_dir):
    data = prepare(str(write_jsonl(tmp_path / "all.jsonl", records("text", 40))), 64, 0, str(model_dir), **QUIET)
    assert len(data.train) == 38 and len(data.val) == 2  # one file: its last 5% held out
    from mlx_lm.utils import load_tokenizer
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode(records("text", 40)[-2]["text"]) + [tokenizer.eos_token_id]
    x, y = data.val.get([0])
    assert list(y[0][:len(ids) - 1]) == ids[1:] and (y[0][len(ids) - 1:] == IGNORE).all()  # ends with eos


@pytest.mark.parametrize("kind,mask_prompt", [("text", False), ("chat", True), ("completions", False)])
def test_each_format_trains_with_diloco(tmp_path, model_dir, kind, mask_prompt):
    config = TrainConfig.from_dict(dict(model=str(model_dir), data=str(data_folder(tmp_path, kind)), seq_len=64,
                                        batch_size=4, workers=2, steps=8, sync_every=4, eval_sequences=8,
                                        lr=3e-3, warmup=0, mask_prompt=mask_prompt))
    run = Run(config, tmp_path / "run", SimCommunicator(2), **QUIET)
    assert run.workers.loss_fn is masked_cross_entropy
    first = run.workers.eval_params(run.global_params(), run.eval_batches)
    summary = run.train()
    assert summary["final_eval_loss"] < first - 0.1, (first, summary["final_eval_loss"])


def test_workers_shards_hold_whole_examples(tmp_path, model_dir):
    data = prepare(str(data_folder(tmp_path, "chat")), 64, 0, str(model_dir), mask_prompt=True, **QUIET)
    samplers = [ShardSampler(len(data.train), w, 2, seed=0) for w in range(2)]
    taken = [s.next_indices(20) for s in samplers]  # one epoch of each shard
    assert sorted(np.concatenate(taken).tolist()) == list(range(40))
    for indices in taken:  # a batch's rows are examples: each starts as the chat template does, "<|system|>"
        x, y = data.train.get(indices)
        assert (x[:, 0] == x[0, 0]).all() and ((y != IGNORE).sum(1) > 0).all()


def test_long_examples_are_cut_and_counted_once(tmp_path, model_dir):
    long = [{"prompt": "Speak. " * 5, "completion": "Now. " * (40 + i)} for i in range(5)]
    long.append({"prompt": "Speak. " * 40, "completion": "Now."})  # its prompt alone is longer
    folder = tmp_path / "long"
    write_jsonl(folder / "train.jsonl", long + records("completions", 10))  # these: at most 81 tokens
    write_jsonl(folder / "valid.jsonl", long[:2] + records("completions", 4))
    said = []
    data = prepare(str(folder), 100, 0, str(model_dir), mask_prompt=True, log=said.append)
    assert said == ["8 of 22 examples are longer than seq-len 100 + 1 tokens and were cut to it (1 of them to "
                    "their prompt alone: they train nothing); "
                    "raise --seq-len or split them to train on their ends"]
    x, y = data.train.get([0, 5, 6])
    assert x.shape == (3, 100) and (y[:, -1] != IGNORE).tolist() == [True, False, False]  # cut: trained to its end
    assert (y[1] == IGNORE).all()


@pytest.mark.parametrize("line,error", [
    ('{"text": "fine"', r"train.jsonl line 3 is not JSON \(Expecting ',' delimiter\); write one JSON object a line"),
    ('{"question": "who?"}', r"train.jsonl line 3 has the keys question; give each line one record like line 1's"),
    ('["a list"]', r"train.jsonl line 3 is a JSON list, not an object"),
    ('{"messages": [{"role": "user", "content": "hi"}]}',
     r"train.jsonl line 3 has the keys messages; give each line one record like line 1's, a text record"),
])
def test_bad_lines_are_named(tmp_path, model_dir, line, error):
    path = write_jsonl(tmp_path / "d" / "train.jsonl", records("text", 2) + [line] + records("text", 20))
    with pytest.raises(ConfigError, match=error):
        prepare(str(path.parent), 64, 0, str(model_dir), **QUIET)


@pytest.mark.parametrize("kind,line,error", [
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]},
     r"""line 3: messages\[1\]'s "content" is 5, not a string; write it as text \("..."\)$"""),
    ("chat", {"messages": [{"role": "user", "content": ["hi"]}]}, r"""line 3: messages\[0\]'s "content" is \["hi"\]"""),
    ("chat", {"messages": [{"content": "hi"}]}, r"""line 3: messages\[0\] is not a \{"role": ..., "content": ...\} object"""),
    ("chat", {"messages": "hi"}, r"""line 3: "messages" is not a list of messages; write it as \[\{"role": "user", """
                                 r""""content": "..."\}, \{"role": "assistant", "content": "..."\}\]$"""),  # not "as text"
    ("completions", {"prompt": "q", "completion": None}, r"""line 3: "completion" is null, not a string"""),
    ("text", {"text": {"a": 1}}, r"""line 3: "text" is \{"a": 1\}, not a string"""),
])
def test_records_hold_text_where_the_template_takes_text(tmp_path, model_dir, kind, line, error):
    """A chat record with "content": 5 trained silently (as the characters "5")."""
    path = write_jsonl(tmp_path / "d" / "train.jsonl", records(kind, 2) + [json.dumps(line)] + records(kind, 20))
    with pytest.raises(ConfigError, match=error):
        prepare(str(path.parent), 64, 0, str(model_dir), **QUIET)


def test_chat_without_template_and_mask_prompt_without_prompts(tmp_path, model_dir):
    plain = tmp_path / "plain-tokenizer"
    shutil.copytree(model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    with pytest.raises(ConfigError, match=r"chat/train.jsonl line 1: chat records need a chat template, and the "
                                          "tokenizer has none; use an instruct model's folder"):
        prepare(str(data_folder(tmp_path, "chat")), 64, 0, str(plain), **QUIET)
    with pytest.raises(ConfigError, match=r"text/train.jsonl holds \{\"text\"\} records, which have no prompt"):
        prepare(str(data_folder(tmp_path, "text")), 64, 0, str(model_dir), mask_prompt=True, **QUIET)
    with pytest.raises(ConfigError, match="mask-prompt needs prompts to mask, and data shakespeare is not JSONL"):
        prepare("shakespeare", 64, 300, str(model_dir), mask_prompt=True, **QUIET)


def test_cli_says_one_line_and_writes_nothing(tmp_path, model_dir):
    folder = data_folder(tmp_path, "chat")
    write_jsonl(folder / "valid.jsonl", records("chat", 3) + ["not json"])
    out = run_cli("sim", "--model", model_dir, "--data", folder, "--mask-prompt", "--steps", "2",
                  "--run-dir", tmp_path / "run", env={"MLX_DILOCO_CACHE": str(tmp_path / "cache")})
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [f"mlx-diloco: error: {folder / 'valid.jsonl'} line 4 is not JSON (Expecting value); "
                                               f"write one JSON object a line: {FORMATS}"]
    # Nothing of the data is cached (the machine's measured GFLOP/s, which the start line's H estimate
    # reads, may be: it is the machine's, not the run's).
    assert not (tmp_path / "run").exists()
    assert not [p.name for p in (tmp_path / "cache").glob("*") if not p.name.startswith("peak-gflops.")]


def test_a_shard_holds_a_workers_whole_examples_as_it_would_read_them(tmp_path, model_dir):
    from mlx_diloco.data.datasets import load_shard, write_shard
    data = prepare(str(data_folder(tmp_path, "chat")), 64, 0, str(model_dir), mask_prompt=True, **QUIET)
    for w in range(3):  # 40 examples: shards of 14, 13 and 13
        shard = load_shard(write_shard(data, w, 3, tmp_path / "shards" / f"worker-{w}"))
        assert shard.masked_targets and shard.is_shard and shard.vocab_size == data.vocab_size
        assert len(shard.train) == len(range(w, 40, 3)) and shard.tokens_per_example() == 64
        assert (shard.tokenizer_dir / "tokenizer_config.json").read_text() == \
            (model_dir / "tokenizer_config.json").read_text()  # with its chat template
        read = ShardSampler(len(data.train), w, 3, seed=5)
        shipped = ShardSampler(len(shard.train), w, 3, seed=5, is_shard=True)
        for _ in range(6):  # batches across epochs (a shard reshuffles at each)
            for ours, theirs in zip(data.train.get(read.next_indices(4)), shard.train.get(shipped.next_indices(4))):
                np.testing.assert_array_equal(ours, theirs)
        for ours, theirs in zip(data.eval_batches(4, 2), shard.eval_batches(4, 2)):
            np.testing.assert_array_equal(ours, theirs)


def test_worker_processes_trained_from_shards_evaluate_as_sim(tmp_path, model_dir):
    """Two `mlx-diloco worker` processes over MLX's ring, each given its shard as an agent gives it,
    against the simulator reading the data itself: the same eval losses."""
    import os
    import subprocess
    import sys
    from mlx_diloco.cluster.launcher import cut_shards
    from mlx_diloco.training.processes import free_ports
    from mlx_diloco.worker_job import WorkerJob
    config = TrainConfig.from_dict(dict(model=str(model_dir), data=str(data_folder(tmp_path, "completions")),
                                        seq_len=64, batch_size=4, workers=2, steps=8, sync_every=4,
                                        eval_sequences=8, lr=3e-3, warmup=0, mask_prompt=True, compress="fp32"))
    Run(config, tmp_path / "sim", SimCommunicator(2), **QUIET).train()
    cut_shards(config, 2, tmp_path / "shards", **QUIET)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    procs = []
    for rank in range(2):
        job = tmp_path / f"job-{rank}.json"
        WorkerJob(config.to_dict(), str(tmp_path / "ring"), data_dir=str(tmp_path / "shards" / f"worker-{rank}"),
                  num_shards=2).write(job)
        procs.append(subprocess.Popen([sys.executable, "-m", "mlx_diloco", "worker", "--job", str(job)],
                                      env={**os.environ, "MLX_RANK": str(rank),
                                           "MLX_HOSTFILE": str(hostfile)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, out[-2000:]
    losses = lambda run: [json.loads(row)["eval_loss"] for row in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses("sim")) == 3 and losses("ring") == pytest.approx(losses("sim"), rel=1e-5)


def test_examples_given_one_batch_at_a_time_are_not_cut_into_shards(tmp_path):
    from mlx_diloco.data.datasets import BatchStream, Dataset, write_shard
    with pytest.raises(ConfigError, match="^BatchStream examples cannot be cut into shards for the workers; put "
                                          "the data on every machine and pass --data-on-workers$"):
        write_shard(Dataset(BatchStream([]), BatchStream([])), 0, 2, tmp_path / "shard")
    assert not (tmp_path / "shard").exists()  # nothing half-written
