"""A user's callback hears what the run's own files record (training/callbacks.py)."""

import importlib.util
import json

import pytest

from conftest import tiny_config
from mlx_diloco.config import ConfigError
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.training.callbacks import TrainingCallback, mlx_lm_train_info, mlx_lm_val_info
from mlx_diloco.training.run import Run


class Recorder(TrainingCallback):
    def __init__(self):
        self.begin, self.train, self.val, self.sync, self.end = [], [], [], [], []

    def on_train_begin(self, info):
        self.begin.append(info)

    def on_train_loss_report(self, info):
        self.train.append(info)

    def on_val_loss_report(self, info):
        self.val.append(info)

    def on_sync_report(self, info):
        self.sync.append(info)

    def on_train_end(self, summary):
        self.end.append(summary)


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_user_callback_hears_the_train_val_and_sync_reports(tmp_path):
    # Streaming DiLoCo: fragments sync at their own steps, each exchange lands a step later
    config = tiny_config(steps=12, sync_every=4, fragments=2, overlap_steps=1, eval_every=4)
    heard = Recorder()
    summary = Run(config, tmp_path / "r", SimCommunicator(2), log=lambda m: None, callbacks=[heard]).train()
    assert heard.begin == [{"step": 0, "steps": 12}] and heard.end == [summary]
    assert summary == json.loads((tmp_path / "r" / "summary.json").read_text())
    # the rows of metrics.jsonl and exchanges.jsonl, with the same numbers
    assert heard.val == rows(tmp_path / "r" / "metrics.jsonl") and [r["step"] for r in heard.val] == [0, 4, 8, 12]
    assert heard.sync == rows(tmp_path / "r" / "exchanges.jsonl")
    assert {r["what"] for r in heard.sync} == {"fragment 0", "fragment 1"} and heard.sync[0]["step"] == 3
    # a train report at every step: its loss averaged between evaluations is the row's train loss
    assert [r["step"] for r in heard.train] == list(range(1, 13))
    for row in heard.val[1:]:
        losses = [r["loss"] for r in heard.train if row["step"] - 4 < r["step"] <= row["step"]]
        assert row["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    sent = {r["step"]: r["bytes_sent"] for r in heard.train}
    assert all(sent[row["step"]] == row["bytes_sent_per_worker"] for row in heard.val[1:])
    assert sent[12] == summary["bytes_sent_per_worker"] == sum(r["sent_bytes"] for r in heard.sync) > 0


def test_steps_taken_one_by_one_report_too(tmp_path):
    heard = Recorder()
    run = Run(tiny_config(steps=12, sync_every=4), tmp_path / "r", SimCommunicator(2), log=lambda m: None,
              callbacks=[heard])
    for _ in range(4):
        run.step()
    assert run.steps_done == 4 and [r["step"] for r in heard.train] == [1, 2, 3, 4]
    assert [r["step"] for r in heard.val] == [0, 4] and [r["step"] for r in heard.sync] == [4]
    assert heard.begin == heard.end == []  # Run.train's own


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_report_to_a_missing_logger_is_one_line_before_the_run(tmp_path):
    with pytest.raises(ConfigError) as e:
        Run(tiny_config(report_to="wandb"), tmp_path / "r", SimCommunicator(2), log=lambda m: None)
    assert str(e.value) == "report-to wandb: the wandb package is not installed; pip install wandb " \
                           "(or drop --report-to wandb)"
    assert not (tmp_path / "r").exists()  # said before the run folder is made


def test_reports_in_mlx_lm_s_keys(tmp_path):
    """What report-to's loggers get: a run's real reports in the keys of mlx-lm's train_info and
    val_info (tuner/trainer.py), with numbers only (what wandb.log and swanlab.log chart)."""
    heard = Recorder()
    Run(tiny_config(steps=8, sync_every=4), tmp_path / "r", SimCommunicator(2), log=lambda m: None,
        callbacks=[heard]).train()
    train = [mlx_lm_train_info(r) for r in heard.train]
    assert [(t["iteration"], t["train_loss"], t["tokens_per_second"]) for t in train] == \
        [(r["step"], r["loss"], r["job_tokens_per_s"]) for r in heard.train]
    val = [mlx_lm_val_info(r) for r in heard.val]
    assert [(v["iteration"], v["val_loss"], v["trained_tokens"]) for v in val] == \
        [(r["step"], r["eval_loss"], r["tokens"]) for r in heard.val]
    assert val[-1]["peak_memory"] == heard.val[-1]["peak_memory_bytes"] / 1e9 > 0  # GB, as mlx-lm's
    assert all(isinstance(v, (int, float)) for info in train + val for v in info.values())
