"""Post-training data (issue 38): preference pairs and GRPO prompts in mlx-lm-lora's and TRL's forms,
tokenized as TRL does (the prompt through the chat template, the completion the tokens after it, its
end of turn included; prompt and padding masked), and every bad line one ConfigError line naming the
file and the line."""

import json

import numpy as np
import pytest

from mlx_diloco.config import ConfigError
from mlx_diloco.data.jsonl import IGNORE
from mlx_diloco.data.post_training import load_post_training
from mlx_diloco.gym.addition import write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The addition task's: one token per character; its template writes a prompt as it is and ends a
    reply with <|endoftext|> (id 0)."""
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    """A byte-level BPE without a chat template."""
    from mlx_diloco.data.datasets import train_bpe
    folder = tmp_path_factory.mktemp("plain")
    train_bpe("the user asks and the assistant answers 1+1=2\n" * 50, 300, folder)
    return folder


def write(folder, train, valid=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    if valid is not None:
        (folder / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in valid))
    return folder


PAIRS = [{"prompt": "12+34=", "chosen": "46", "rejected": "47"}, {"prompt": "5+5=", "chosen": "10", "rejected": "11"}]


def load(objective, folder, tokenizer, seq_len=16, max_completion=6):
    return load_post_training(objective, str(folder), str(tokenizer), seq_len, max_completion, log=lambda m: None)


def ids(text):
    return [0 if c == "$" else "0123456789+=".index(c) + 1 for c in text]  # $: the end of text


def test_pairs_are_tokenized_as_trl_does_prompt_and_padding_masked(tmp_path, tokenizer):
    data = load("dpo", write(tmp_path, PAIRS, PAIRS[:1]), tokenizer)
    x, y = data.train.get([0, 1])
    assert x.shape[0] == 4  # the two chosen rows, then the two rejected ones
    chosen, rejected = ids("12+34=46$"), ids("12+34=47$")
    np.testing.assert_array_equal(x[0, :8], chosen[:-1])
    np.testing.assert_array_equal(x[2, :8], rejected[:-1])
    # targets: IGNORE on the prompt ("12+34=" predicts nothing trained) and on the padding
    np.testing.assert_array_equal(y[0], [IGNORE] * 5 + chosen[6:] + [IGNORE] * (x.shape[1] - 8))
    np.testing.assert_array_equal(y[3], [IGNORE] * 3 + ids("11$") + [IGNORE] * (x.shape[1] - 6))
    assert data.tokens_per_example() is None  # an example is a pair


def test_chat_forms_of_pairs_give_the_same_tokens(tmp_path, tokenizer):
    user = [{"role": "user", "content": "12+34="}]
    forms = [{"prompt": user, "chosen": [{"role": "assistant", "content": "46"}],
              "rejected": [{"role": "assistant", "content": "47"}]},                           # TRL conversational
             {"chosen": user + [{"role": "assistant", "content": "46"}],
              "rejected": user + [{"role": "assistant", "content": "47"}]},                    # the prompt implicit
             {"prompt": "12+34=", "chosen": {"messages": [{"role": "assistant", "content": "46"}]},
              "rejected": {"messages": [{"role": "assistant", "content": "47"}]}}]             # mlx-lm-lora's ORPO
    expected = load("dpo", write(tmp_path / "plain", PAIRS[:1] * 2, PAIRS[:1]), tokenizer).train.get([0])
    for i, form in enumerate(forms):
        got = load("orpo", write(tmp_path / str(i), [form] * 2, [form]), tokenizer).train.get([0])
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


def test_grpo_prompts_and_their_answers_as_the_held_out_completions(tmp_path, tokenizer):
    records = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "5+5=", "answer": "10"}]
    data = load("grpo", write(tmp_path, records, records[:1]), tokenizer)
    x, indices = data.train.get([1, 0])
    np.testing.assert_array_equal(indices, [1, 0])
    np.testing.assert_array_equal(x[0], ids("5+5=") + [0, 0])
    assert data.train.answers == ["46", "10"] and data.train.prompts == ["12+34=", "5+5="]
    vx, vy = data.val.get([0])  # the held-out loss: the answer's NLL
    assert list(vy[0][vy[0] != IGNORE]) == ids("46$")
    assert data.held_out.answers == ["46"]


def test_plain_text_without_a_chat_template_gets_eos_after_the_completion(tmp_path, plain_tokenizer):
    from mlx_lm.utils import load_tokenizer
    tok = load_tokenizer(plain_tokenizer)
    data = load("dpo", write(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 3), plain_tokenizer)
    x, y = data.train.get([0])
    assert list(y[0][y[0] != IGNORE]) == tok.encode("2", add_special_tokens=False) + [tok.eos_token_id]


BAD_PAIRS = [
    ({"prompt": "1+1=", "chosen": "2"}, 'missing "rejected"'),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "  "}, '"rejected" is empty'),
    ({"prompt": "1+1=", "chosen": 2, "rejected": "3"}, '"chosen" must be a string or a list of messages'),
    ({"prompt": "1+1=", "chosen": [{"role": "assistant"}], "rejected": "3"}, '"chosen" must be a string'),
    ({"messages": [{"role": "user", "content": "1+1="}]}, 'missing "chosen"; write each line as {"prompt": ..., '
                                                          '"chosen": ..., "rejected": ...} (a {"messages"} record is '
                                                          'SFT data: train it with --objective sft)'),
    ({"prompt": "1" * 20, "chosen": "2", "rejected": "3"}, "the prompt is 20 tokens"),
    ({"prompt": "1" * 10, "chosen": "2" * 10, "rejected": "3"}, 'the prompt and "chosen" are 21 tokens'),
    ({"prompt": "1+1=", "system": 3, "chosen": "2", "rejected": "3"}, '"system" must be a string'),
]


@pytest.mark.parametrize("record, problem", BAD_PAIRS)
def test_a_bad_preference_line_is_one_line_naming_file_and_line(tmp_path, tokenizer, record, problem):
    folder = write(tmp_path, PAIRS + [record], PAIRS)
    with pytest.raises(ConfigError) as e:
        load("dpo", folder, tokenizer)
    assert f"{folder / 'train.jsonl'} line 3: {problem}" in str(e.value) and "\n" not in str(e.value)


BAD_PROMPTS = [
    ({"prompt": "1+1="}, 'missing "answer"'),
    ({"prompt": "1+1=", "answer": 2}, '"answer" must be a string, not 2; write it in quotes'),
    ({"answer": "2"}, 'missing "prompt"'),
    ({"prompt": "1" * 12, "answer": "2"}, "the prompt is 12 tokens, and max-completion-length 6 exceed seq-len 16"),
    ({"prompt": "1+1=", "answer": "1234567"}, "the answer is 8 tokens, more than max-completion-length 6"),
]


@pytest.mark.parametrize("record, problem", BAD_PROMPTS)
def test_a_bad_grpo_line_is_one_line_naming_file_and_line(tmp_path, tokenizer, record, problem):
    good = [{"prompt": "1+1=", "answer": "2"}] * 2
    folder = write(tmp_path, good, [record])
    with pytest.raises(ConfigError) as e:
        load("grpo", folder, tokenizer)
    assert f"{folder / 'valid.jsonl'} line 1: {problem}" in str(e.value) and "\n" not in str(e.value)


def test_chat_messages_need_a_chat_template(tmp_path, plain_tokenizer):
    record = {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}], "answer": "2"}
    with pytest.raises(ConfigError, match="line 1: chat messages need a chat template"):
        load("grpo", write(tmp_path, [record] * 3), plain_tokenizer)


def test_data_that_is_not_jsonl_is_refused_with_the_form(tmp_path, tokenizer):
    (tmp_path / "text.txt").write_text("1+1=2\n" * 100)
    with pytest.raises(ConfigError, match=r'objective grpo reads JSONL.*\{"prompt": \.\.\., "answer": \.\.\.\}'):
        load("grpo", tmp_path / "text.txt", tokenizer)


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_an_empty_file_is_told_the_objectives_record_form(tmp_path, tokenizer, objective):
    """An empty DPO file was told to use SFT's record formats."""
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(ConfigError) as e:
        load(objective, tmp_path / "train.jsonl", tokenizer)
    form = '{"prompt": ..., "answer": ...}' if objective == "grpo" else '{"prompt": ..., "chosen": ..., "rejected": ...}'
    assert str(e.value) == f"{tmp_path / 'train.jsonl'} holds no records; write one a line: {form}"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from conftest import addition_task
    return addition_task(tmp_path_factory.mktemp("addition"))


GOOD_LINE = {"sft": {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},
             "dpo": PAIRS[0], "grpo": {"prompt": "1+1=", "answer": "2"}}


@pytest.mark.parametrize("objective", ["sft", "dpo", "grpo"])
def test_data_that_is_not_utf8_is_one_line_naming_its_line_and_leaves_nothing(tmp_path, task, objective):
    """Issue 43: a 31-line traceback ending in UnicodeDecodeError, for SFT chat, DPO and GRPO files, in
    the command line (a file saved as latin-1) and the API (a binary file)."""
    from conftest import run_cli
    from mlx_diloco import Trainer
    latin1, binary = tmp_path / "latin1.jsonl", tmp_path / "binary.jsonl"
    latin1.write_bytes(json.dumps(GOOD_LINE[objective]).encode() + b'\n{"prompt": "caf\xe9"}\n')
    binary.write_bytes(bytes(range(128, 256)))
    fix = "save the file as UTF-8 (a latin-1 file: iconv -f latin1 -t utf-8 {}), or pass a JSONL file"
    out = run_cli("sim", "--model", task / "model", "--data", latin1, "--objective", objective, "--fine-tune-type",
                  "lora", "--steps", 2, "--run-dir", tmp_path / "cli")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (f"mlx-diloco: error: {latin1} line 2 is not UTF-8 text (byte 0xe9 "
                                                   f"at column 16); " + fix.format("latin1.jsonl"))
    with pytest.raises(ConfigError) as e:
        Trainer(str(task / "model"), None, str(binary), objective=objective, fine_tune_type="lora",
                run_dir=tmp_path / "api", log=lambda m: None).fit("diloco", workers=2, steps=2)
    assert str(e.value) == f"{binary} line 1 is not UTF-8 text (byte 0x80 at column 1); " + fix.format("binary.jsonl")
    assert not (tmp_path / "cli").exists() and not (tmp_path / "api").exists()
