"""The run's records are declared once (records.py): what a run writes is exactly what is declared,
and a key that is not declared is refused where it is written."""

import json

import pytest

from conftest import tiny_config
from mlx_diloco import records
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.training.callbacks import TrainingCallback
from mlx_diloco.training.run import Run


def test_a_runs_rows_and_summary_are_the_declared_keys(tmp_path):
    run = Run(tiny_config(steps=8), tmp_path / "run", SimCommunicator(2), log=lambda m: None)
    summary = run.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 4, 8]
    assert all(list(r) == list(records.ROW) for r in rows)
    assert list(summary) == list(records.SUMMARY)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()).keys() >= records.SUMMARY.keys()
    arrays, _ = run.state()
    assert set(arrays) == set(records.CHECKPOINT)


def test_every_key_has_a_line_of_help_and_a_stray_key_is_refused():
    for declared in (records.ROW, records.SUMMARY, records.CHECKPOINT):
        assert all(isinstance(h, str) and h and "\n" not in h for h in declared.values())
    with pytest.raises(KeyError, match="metrics row keys not declared in records.py: eval_los"):
        records.metrics_row(step=0, eval_los=1.0)


def test_every_second_of_a_run_is_in_its_time_split(tmp_path):
    """Each row's, the summary's and each train report's time_s split the run's wall-clock (process_s)
    into records.TIME's parts, every second in one: they sum to it within 2%."""
    heard = []

    class Reports(TrainingCallback):
        def on_train_loss_report(self, info):
            heard.append(info)

    run = Run(tiny_config(steps=8), tmp_path / "run", SimCommunicator(2), log=lambda m: None, callbacks=[Reports()])
    summary = run.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in rows + heard + [summary]:
        split = record["time_s"]
        assert list(split) == list(records.TIME) and min(split.values()) >= 0
        assert sum(split.values()) == pytest.approx(record["process_s"], rel=0.02), record
    assert all(summary["time_s"][part] > 0 for part in ("startup_s", "compute_s", "eval_s", "save_s"))
    assert summary["process_s"] >= rows[-1]["process_s"] >= rows[0]["process_s"] > 0
