"""What a holder of the cluster secret may make an agent do on its machine (issue 36): run no code
but mlx-diloco's own (a shipped data file named evil.py is never imported; builders only with
--allow-code), read models and data only under the folders its owner allowed, keep no abandoned
upload, and answer hostile requests with one line each, no traceback in its log. And a relative
--state-dir works; a failure that repeats word for word is not retried."""

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import run_cli, tiny_config
from mlx_diloco.cluster import protocol
from mlx_diloco.cluster.discovery import AgentClient, AgentError, Found
from mlx_diloco.worker_job import WorkerJob

SECRET = "agent-limits-secret-0123456789"


class LiveAgent:
    """A real `mlx-diloco agent` on the loopback, in its own process, with `flags`."""

    def __init__(self, folder, *flags, state_dir=None, cwd=None):
        self.log = folder / "agent.log"
        self.state = state_dir or folder / "state"
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_diloco", "agent", "--no-mdns", "--bind", "127.0.0.1",
                                      "--port", "0", "--state-dir", str(self.state), *map(str, flags)],
                                     stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True, cwd=cwd,
                                     env={**os.environ, "MLX_DILOCO_SECRET": SECRET})
        line = self.proc.stdout.readline()
        found = re.search(r"ready on port (\d+)", line)
        assert found, self.log.read_text()
        self.port = int(found.group(1))
        self.client = AgentClient(Found("127.0.0.1", self.port), SECRET.encode())

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def agent(tmp_path):
    a = LiveAgent(tmp_path, "--models-dir", tmp_path / "models", "--data-dir", tmp_path / "data")
    yield a
    a.close()


def ship(client, data: bytes) -> str:
    """Send `data` as a blob, as a launcher ships a data file; its digest."""
    digest = hashlib.sha256(data).hexdigest()
    client.request("put_chunk", digest=digest, offset=0, size=len(data), data=data)
    return digest


def start(client, config: dict, files: dict = None, job="j"):
    worker = WorkerJob(config, data_worker=0, collective_timeout=30, num_shards=1 if files else None)
    return client.request("start", job=job, rank=0, hostfile=[["127.0.0.1:1"]], worker=worker.for_agent(),
                          files=files or {})


def finished(agent, job: str) -> dict:
    """The status of the job's worker once it has exited."""
    deadline = time.time() + 120
    while (status := agent.client.request("status", job=job, metrics_from=0, exchanges_from=protocol.NO_LOG,
                                          log_from=0))["state"] == "running":
        assert time.time() < deadline
        time.sleep(0.2)
    return status


EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\ndef build():\n    pass\nloss = build\n"


@pytest.mark.parametrize("key", ["model", "loss"])
def test_a_shipped_python_file_is_never_imported(tmp_path, key):
    """The attack of issue 36: a data file evil.py lands in jobs/JOB/data-0/, and a config naming
    `data-0.evil:build` made the worker import it (it was on sys.path: the worker's working folder).
    Without --allow-code the agent refuses the name in one line; with it, the worker looks for the
    module among those installed, does not find it, and the file never runs."""
    from mlx_diloco.cluster.launcher import cut_shards
    marker = tmp_path / "outside-the-state-folder"
    config = tiny_config(workers=1, steps=2)
    shard = cut_shards(config, 1, tmp_path / "shards", log=lambda m: None)["0"]  # a real shard beside it
    config = {**config.to_dict(), key: "data-0.evil:build"}
    for flags in ([], ["--allow-code"]):
        agent = LiveAgent(tmp_path, *flags)
        try:
            for name, digest in shard.items():
                ship(agent.client, (tmp_path / "shards" / "worker-0" / name).read_bytes())
            files = {**shard, "evil.py": ship(agent.client, EVIL.format(marker=str(marker)).encode())}
            if not flags:
                with pytest.raises(AgentError) as refused:
                    start(agent.client, config, files)
                what = "model" if key == "model" else "loss function"
                assert str(refused.value).endswith(
                    f"refused 'start': {what} 'data-0.evil:build' names Python code (package.module:function), "
                    "which this agent imports only when started with --allow-code")
                continue
            start(agent.client, config, files)
            status = finished(agent, "j")
            assert status["returncode"] == 2, status["log"]
            assert "cannot load" in status["log_tail"] and "'data-0.evil:build'" in status["log_tail"]
        finally:
            agent.close()
        assert (agent.state / "jobs" / "j" / "data-0" / "evil.py").exists()  # it was there to import
    assert not marker.exists()


def test_models_and_data_resolve_only_under_the_folders_the_owner_allowed(agent, tmp_path):
    from conftest import tiny_llama_folder
    from mlx_diloco.cluster.allowed import hf_cache
    allowed = tiny_llama_folder(tmp_path / "models" / "llama")
    elsewhere = tiny_llama_folder(tmp_path / "elsewhere")  # as ~/.ssh would be: a folder the owner did not name
    (tmp_path / "models" / "link-out").symlink_to(elsewhere)
    ask = lambda model: agent.client.request("has_model", model=model)
    assert ask(str(allowed))["present"] and not ask(str(allowed))["refused"]
    for model in (str(elsewhere), str(tmp_path / "models" / "link-out"), "/etc"):
        answer = ask(model)
        assert not answer["present"] and answer["folder"] == ""
        assert answer["refused"] == (
            f"model '{model}' is outside the folders this agent's jobs may read it from ({tmp_path / 'models'}, "
            f"{hf_cache()}); start the agent with --models-dir naming a folder that holds it"), answer
    assert ask("models/llama/x")["refused"].startswith("model 'models/llama/x' must be an absolute path")
    assert ask("x" * 100_000)["refused"] == "model name of 100000 characters: not a path"
    assert ask("a\0b")["refused"] == "model name of 3 characters with a NUL byte: not a path"
    assert ask(str(agent.state / "jobs"))["refused"].endswith("is in this agent's state folder, which holds what "
                                                              "launchers send; name it elsewhere")
    # A job's paths, read by its worker: the data (read there with --data-on-workers), the tokenizer.
    base = tiny_config(workers=1, steps=2).to_dict()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "text.txt").write_text("hello " * 1000)
    for change, why in ((dict(data="/etc/passwd"), "data '/etc/passwd' is outside the folders this agent's jobs may "
                                                   f"read it from ({tmp_path / 'data'}); start the agent with --data-dir"),
                        (dict(tokenizer=str(elsewhere)), f"tokenizer '{elsewhere}' is outside the folders"),
                        (dict(model=str(elsewhere)), f"model '{elsewhere}' is outside the folders")):
        with pytest.raises(AgentError, match="refused 'start': " + re.escape(why)):
            start(agent.client, {**base, **change})
    start(agent.client, {**base, "data": str(tmp_path / "data" / "text.txt")}, job="allowed")  # accepted
    assert finished(agent, "allowed")["returncode"] == 0
    assert list((agent.state / "cache" / "text").iterdir())  # its token cache: in the state folder
    assert "Traceback" not in agent.log.read_text()


def test_uploads_must_fit_the_disk_and_abandoned_ones_expire(agent):
    from mlx_diloco.cluster.agent import UPLOAD_MAX_AGE_S
    with pytest.raises(AgentError, match=r"refused 'put_chunk': a blob of 1000\.0 GB does not fit: .* GB of this "
                                         r"machine's disk is free for uploads \(with 1 GB kept free\); free some disk"):
        agent.client.request("put_chunk", digest="a" * 64, offset=0, size=10 ** 12, data=b"x" * 10)
    # An upload its launcher abandoned: half sent, then nothing for longer than UPLOAD_MAX_AGE_S.
    agent.client.request("put_chunk", digest="b" * 64, offset=0, size=100, data=b"x" * 50)
    partial = agent.state / "blobs" / ("b" * 64 + ".partial")
    old = time.time() - UPLOAD_MAX_AGE_S - 1
    os.utime(partial, (old, old))
    ship(agent.client, b"another upload")
    assert not partial.exists() and "removed an upload unfinished" in agent.log.read_text()


HOSTILE = [
    ("has_model", dict(model="m" * 100_000)),
    ("has_model", dict(model="\0")),
    ("has_model", dict(model="../" * 2000)),
    ("has_blob", dict(digest="x" * 100_000)),
    ("put_chunk", dict(digest="c" * 64, offset=-5, size=10, data=b"x")),
    ("put_chunk", dict(digest="c" * 64, offset=0, size=-1, data=b"x")),
    ("put_chunk", dict(digest="c" * 64, offset=0, size=(1 << 63) - 1, data=b"x")),
    ("start", dict(job="j", rank=0, hostfile=[["127.0.0.1:1"]], files={},
                   worker=dict(config={"model": "m" * 100_000}, data_worker=0, collective_timeout=30))),
    ("start", dict(job="j", rank=0, hostfile=[["127.0.0.1:1"]], files={},
                   worker=dict(config={"data": "\0"}, data_worker=0, collective_timeout=30))),
    ("start", dict(job="j", rank=0, hostfile=[["127.0.0.1:1"]], files={"a": 5},
                   worker=dict(config={"workers": 1}, data_worker=0, collective_timeout=30))),
    ("start", dict(job="j", rank=0, hostfile=[["127.0.0.1:1"]], files={"a": "b" * 64},
                   worker=dict(config={"workers": 1}, data_worker=0, num_shards="two", collective_timeout=30))),
    ("start", dict(job="j", rank=0, hostfile=[["127.0.0.1:1"]], files={},
                   worker=dict(config={"workers": 1}, data_worker=0, collective_timeout=30, ring_slots="x"))),
    ("start", dict(job="j", rank=0, hostfile=[[5]], files={},
                   worker=dict(config={"workers": 1}, data_worker=0, collective_timeout=30, ring_slots=[0]))),
    ("start", dict(job="j", rank=0, hostfile=[["127.0.0.1:1"]], files={},
                   worker=dict(config={"workers": 1}, data_worker=(1 << 63) - 1, collective_timeout=float("nan")))),
    ("start", dict(job="j", rank=0, hostfile=[["127.0.0.1:1"]], files={},
                   worker=dict(config={"workers": 1}, data_worker=0, data_dir="/etc"))),
    ("status", dict(job="j" * 65, metrics_from=0, exchanges_from=0, log_from=0)),
    ("status", dict(job="j", metrics_from=-(1 << 63), exchanges_from=0, log_from=-1)),
    ("save_and_exit", dict(job="j", when="now", after=(1 << 63) - 1)),
    ("measure_link", dict(job="l", rank=0, hostfile=[["127.0.0.1:1"], ["127.0.0.1:2"]], sizes=["a"],
                          link_kind="ethernet", peer={"id": 5, "host": None}, collective_timeout=5)),
]


def test_hostile_requests_get_one_line_and_no_traceback(agent):
    """Requests signed with the secret but built to break the agent: each is refused in one line (or,
    asking for nothing it has, answered so), the agent logs no traceback, and it still answers."""
    for kind, fields in HOSTILE:
        try:
            why = agent.client.request(kind, **fields).get("refused", "")  # has_model answers, saying why not
        except AgentError as e:
            why = str(e)
        assert "\n" not in why and len(why) < 600, (kind, why[:600])
    log = agent.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert agent.client.request("heartbeat")["type"] == "ok"


# ---------------------------------------------------------------- launch against such agents

def launch(tmp_path, agent, *flags):
    config = tiny_config(workers=1, steps=4, sync_every=2)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in config.to_dict().items() if not isinstance(v, bool)]
    return subprocess.run([sys.executable, "-m", "mlx_diloco", "launch", *args, f"--hosts=127.0.0.1:{agent.port}",
                           "--run-dir", str(tmp_path / "run"), *flags], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MLX_DILOCO_SECRET": SECRET})


def failures(tmp_path) -> list:
    return [e for e in map(json.loads, (tmp_path / "run" / "events.jsonl").read_text().splitlines())
            if e["event"] == "failure"]


def test_an_agent_with_a_relative_state_dir_runs_jobs(tmp_path):
    """Its workers were handed state/jobs/JOB/job.json and read it from the job folder: every job failed."""
    (tmp_path / "home").mkdir()
    agent = LiveAgent(tmp_path, state_dir="state", cwd=tmp_path / "home")
    try:
        out = launch(tmp_path, agent)
    finally:
        agent.close()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0 restart(s)" in out.stdout and (tmp_path / "home" / "state" / "jobs").is_dir()


def test_launch_stops_a_failure_that_repeats_word_for_word_and_shows_the_worker_s_line(tmp_path):
    """A loss function the machine lacks fails every start the same way: one restart, then the
    worker's line, rather than five restarts of the same error."""
    agent = LiveAgent(tmp_path, "--allow-code", "--name", "mini1")
    try:
        out = launch(tmp_path, agent, "--loss=no_such_module:loss")
    finally:
        agent.close()
    assert out.returncode == 2
    worker_line = ("mlx-diloco: error: cannot load loss function 'no_such_module:loss' (ModuleNotFoundError: No module "
                   "named 'no_such_module'); make the module importable (pip install it, or put its folder on "
                   "PYTHONPATH) on every machine")
    assert out.stderr.strip().splitlines()[-1] == ("mlx-diloco: error: job failed: the same failure twice in a row, not "
                                                   "retried: worker 0 (mini1) failed: it exited with code 2: "
                                                   + worker_line)
    assert len(failures(tmp_path)) == 2


def test_launch_says_in_one_line_what_an_agent_does_not_allow(tmp_path):
    agent = LiveAgent(tmp_path)
    try:
        out = launch(tmp_path, agent, "--loss=no_such_module:loss")
    finally:
        agent.close()
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        f"mlx-diloco: error: job failed: agent at 127.0.0.1:{agent.port} refused 'start': loss function "
        "'no_such_module:loss' names Python code (package.module:function), which this agent imports only when "
        "started with --allow-code")


# ---------------------------------------------------------------- the code a job names (issue 43)

REWARD = ("import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"
          "def anything(prompts, completions, answer, **kwargs):\n    return [0.0] * len(completions)\n")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The addition task (a tiny Llama with its tokenizer, GRPO prompts): what a GRPO job trains."""
    from conftest import addition_task
    return addition_task(tmp_path_factory.mktemp("addition"))


def grpo_config(task, **keys) -> dict:
    return {**tiny_config(workers=1, steps=2, sync_every=2).to_dict(), "model": str(task / "model"),
            "data": str(task / "grpo"), "objective": "grpo", "fine_tune_type": "lora", "num_layers": -1,
            "batch_size": 2, "group_size": 2, "max_completion_length": 5, "seq_len": 32, **keys}


def owner_agent(tmp_path, task, *flags) -> LiveAgent:
    """An agent whose owner lets jobs load the task's model and read its data."""
    return LiveAgent(tmp_path, "--models-dir", task, "--data-dir", task, *flags)


def test_a_shipped_reward_file_runs_only_where_the_owner_allows_code(tmp_path, task):
    """Route 1 of issue 43: a secret holder uploads evil.py as one of a job's files and names it as a
    GRPO reward file. Without --allow-code the agent refuses in one line and starts nothing; with it,
    the shipped file is the job's reward file (the owner allowed code from launches)."""
    marker = tmp_path / "ran"
    evil = REWARD.format(marker=str(marker)).encode()
    agent = owner_agent(tmp_path, task)
    try:
        with pytest.raises(AgentError) as refused:
            start(agent.client, grpo_config(task, reward_file="evil.py"), {"evil.py": ship(agent.client, evil)})
        assert str(refused.value) == (f"agent at 127.0.0.1:{agent.port} refused 'start': reward file 'evil.py' is "
                                      "Python code, which this agent runs only when started with --allow-code")
        assert agent.client.request("status", job="j", metrics_from=0, exchanges_from=protocol.NO_LOG,
                                    log_from=0)["state"] == "unknown"  # no worker was started
        assert not (agent.state / "jobs" / "j").exists()
    finally:
        agent.close()
    assert not marker.exists() and "Traceback" not in agent.log.read_text()
    agent = owner_agent(tmp_path, task, "--allow-code")
    try:
        start(agent.client, grpo_config(task, reward_file="evil.py"), {"evil.py": ship(agent.client, evil)})
        status = finished(agent, "j")
    finally:
        agent.close()
    assert status["returncode"] == 0, status["log_tail"]
    assert marker.read_text() == "ran"  # the shipped file, where the worker's data folder holds it
    job = json.loads((agent.state / "jobs" / "j" / "job.json").read_text())
    assert job["config"]["reward_file"] == str(agent.state / "jobs" / "j" / "data-0" / "evil.py")
    assert "data_dir" not in job  # only code was shipped: the data is read where the owner allowed it


def test_a_reward_file_on_the_agents_machine_runs_only_from_a_code_folder_the_owner_named(tmp_path, task):
    """Route 2: a reward file naming a .py already on the agent's machine (or one it does not have)."""
    home = tmp_path / "home"
    home.mkdir()
    marker = tmp_path / "ran"
    (home / "evil.py").write_text(REWARD.format(marker=str(marker)))
    for flags, why in (
            ([], f"reward file '{home / 'evil.py'}' is Python code, which this agent runs only when started with "
                 "--allow-code"),
            (["--allow-code"], f"reward file '{home / 'evil.py'}' is outside the folders this agent's jobs may read "
                               "it from (none); start the agent with --code-dir naming a folder that holds it")):
        agent = owner_agent(tmp_path, task, *flags)
        try:
            with pytest.raises(AgentError) as refused:
                start(agent.client, grpo_config(task, reward_file=str(home / "evil.py")))
            assert str(refused.value) == f"agent at 127.0.0.1:{agent.port} refused 'start': {why}"
            with pytest.raises(AgentError, match="refused 'start': reward file 'evil.py' (is Python code|is not one of "
                                                 "the files shipped with the job, nor a path on this machine)"):
                start(agent.client, grpo_config(task, reward_file="evil.py"))  # relative, not shipped
            assert not (agent.state / "jobs" / "j").exists()
        finally:
            agent.close()
    assert not marker.exists()
    agent = owner_agent(tmp_path, task, "--allow-code", "--code-dir", home)
    try:
        start(agent.client, grpo_config(task, reward_file=str(home / "evil.py")))
        assert finished(agent, "j")["returncode"] == 0
    finally:
        agent.close()
    assert marker.read_text() == "ran"  # under the folder its owner named
    out = run_cli("agent", "--code-dir", home, "--state-dir", tmp_path / "s", env={"MLX_DILOCO_SECRET": SECRET})
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "mlx-diloco: error: --code-dir names folders of code jobs may run, which this agent runs only with "
        "--allow-code; pass --allow-code too, or drop --code-dir"]


def test_built_in_rewards_run_where_code_is_not_allowed(tmp_path, task):
    agent = owner_agent(tmp_path, task)
    try:
        start(agent.client, grpo_config(task, reward_functions="exact_answer,format,length", reward_format=r"\d+"))
        status = finished(agent, "j")
    finally:
        agent.close()
    assert status["returncode"] == 0, status["log_tail"]
    rows = [json.loads(line) for line in status["metrics"]]
    assert rows[-1]["objective"] == "grpo" and "reward" in rows[-1]


def test_a_resumed_launch_is_held_to_the_same_rule(tmp_path, task):
    """Route 3: `launch --resume` on a run folder whose launch.json names objective grpo and a reward
    file: the agent, asked to start the resumed job's worker, refuses the reward file before any worker
    starts, from the command as from the launcher's code."""
    from dataclasses import asdict
    from mlx_diloco.cluster.launch_options import LaunchOptions
    from mlx_diloco.cluster.launcher import JobFailed, JobState, Launcher, Member
    from mlx_diloco.cluster.supervisor import Supervisor
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(REWARD.format(marker=str(marker)))
    agent = owner_agent(tmp_path, task)
    try:
        run = tmp_path / "run"
        run.mkdir()
        JobState("attack", grpo_config(task, reward_file=str(tmp_path / "evil.py")),
                 [Member("127.0.0.1", agent.port, worker_id=0, host="mini1")], 1,
                 asdict(LaunchOptions(discover=False))).save(run)
        refusal = (f"agent at 127.0.0.1:{agent.port} refused 'start': reward file '{tmp_path / 'evil.py'}' is Python "
                   "code, which this agent runs only when started with --allow-code")
        out = run_cli("launch", "--resume", "--run-dir", run, env={"MLX_DILOCO_SECRET": SECRET})
        assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == f"mlx-diloco: error: job failed: {refusal}"
        with pytest.raises(JobFailed) as refused:  # the launcher's code, as `launch --resume` runs it
            Supervisor(Launcher(JobState.load(run), run, SECRET.encode(), log=lambda m: None)).run(resume=True)
        assert str(refused.value).endswith(refusal)
        assert not (agent.state / "jobs" / "attack").exists()
    finally:
        agent.close()
    assert not marker.exists()


def test_a_worker_that_exits_on_its_own_is_reaped(agent):
    """It stayed a zombie process until a launcher asked about its job, which may be never."""
    pid = start(agent.client, tiny_config(workers=1, steps=2).to_dict())["pid"]
    deadline, zombie_since = time.time() + 120, None
    while True:  # gone once the agent collects its exit, without being asked
        assert time.time() < deadline, "the worker never exited"
        try:
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            break
        zombie_since = (zombie_since or time.time()) if zombie else None
        assert not zombie_since or time.time() - zombie_since < 5, "the exited worker stays a zombie"
        time.sleep(0.1)
    assert agent.client.request("status", job="j", metrics_from=0, exchanges_from=protocol.NO_LOG,
                                log_from=0)["returncode"] == 0
