"""The worker's job file (worker_job.py): one description of a worker that a cluster's agent and
sim's processes write, and `mlx-diloco worker --job FILE` reads."""

import json

import pytest

from conftest import run_cli, tiny_config
from mlx_diloco.cluster import protocol
from mlx_diloco.cluster.agent import Agent
from mlx_diloco.config import ConfigError
from mlx_diloco.worker_job import WorkerJob


def test_the_agent_starts_its_worker_from_a_job_file(tmp_path):
    """A real agent, given a start request as a launcher sends it, writes the job file (its memory
    cap in the config), and the worker it starts from that file trains, reports progress and
    checkpoints. sim's processes write the same kind of file: test_processes.py finds its rank 1 by
    reading the job on its command line with the same WorkerJob.read."""
    agent = Agent(tmp_path / "state", b"secret", max_memory=2e9)
    config = tiny_config(workers=1, steps=8)
    worker = WorkerJob(config.to_dict(), data_worker=0, collective_timeout=30)  # what a launcher sends
    agent.handle(protocol.validate({"v": protocol.VERSION, "type": "start", "job": "j", "rank": 0,
                                    "hostfile": [["127.0.0.1:1"]], "worker": worker.for_agent(), "files": {}}))
    worker = agent.jobs["j"]
    assert worker.popen.wait(timeout=240) == 0, worker.log.read_text()[-2000:]
    folder = tmp_path / "state" / "jobs" / "j"
    assert WorkerJob.read(folder / "job.json") == WorkerJob(
        {**config.to_dict(), "memory_limit": 2.0}, str(folder / "worker-0"), own_run_dir=True, data_worker=0,
        collective_timeout=30.0, progress=str(folder / "progress.json"))
    assert json.loads((folder / "progress.json").read_text())["step"] == 8
    assert agent.handle({"type": "checkpoints", "job": "j"})["steps"]["0"][0] == 8  # newest first


@pytest.mark.parametrize("text, says", [
    ("{", r"is not a job file: not valid JSON .*WorkerJob's keys"),
    ("[]", r"job file .*: job keys must be a JSON object"),
    ('{"run_dir": "r"}', r"job file .* lacks 'config'; pass the job file that sim or an agent wrote"),
    ('{"config": {}, "run_dir": "r", "resume": 4}', r"unknown job key 'resume'; did you mean 'resume_step'\?"),
    ('{"config": {}, "run_dir": "r", "resume_step": "4"}', r"resume-step must be a whole number, not \"4\""),
], ids=["not-json", "not-an-object", "missing-key", "unknown-key", "wrong-type"])
def test_a_broken_job_file_is_one_line(tmp_path, text, says):
    (tmp_path / "job.json").write_text(text)
    with pytest.raises(ConfigError, match=says):
        WorkerJob.read(tmp_path / "job.json")


def test_the_worker_says_a_missing_job_file_in_one_line(tmp_path):
    out = run_cli("worker", "--job", tmp_path / "job.json")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"mlx-diloco: error: job file {tmp_path / 'job.json'} does not exist; pass the job file that sim or an "
        "agent wrote, or write one: a JSON object of WorkerJob's keys (mlx_diloco/worker_job.py)"], out.stderr
