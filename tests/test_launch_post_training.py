"""Post-training on a cluster (issue 46): `launch --objective dpo|orpo|grpo` ships each worker its shard
of the pairs or prompts as SFT data ships, and trains as `sim` does with the same seed; a reward file
is the job's code, shipped with it, run only where an agent's owner allows code (cluster/allowed.py's
rule), refused in one line before any worker starts elsewhere, while the built-in rewards run
everywhere; a GRPO job's summary carries what generating cost; a worker that leaves mid-round loses
only its own round."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import addition_task, run_cli, tiny_llama_folder
from mlx_diloco.cluster import protocol
from mlx_diloco.cluster.emulated import EmulatedCluster, can_build
from mlx_diloco.cluster.launcher import cut_shards
from mlx_diloco.config import TrainConfig
from mlx_diloco.data.datasets import ShardSampler, load_shard, prepare, write_shard
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.models.zoo import load_spec
from mlx_diloco.training.resolve import load_data
from mlx_diloco.training.run import Run
from test_agent_limits import SECRET as LIVE_SECRET, LiveAgent
from test_cluster import MEMBERSHIP_ATOL, assert_same_params, config_flags, events, finish, launch

QUIET = dict(log=lambda m: None)
needs_namespaces = pytest.mark.skipif(bool(can_build()), reason=can_build())
# The reward file of the tests: 1 for a completion of digits alone, which a random model writes now and then.
DIGITS = "import re\ndef digits(prompts, completions, answer, **kwargs):\n" \
         "    return [float(re.fullmatch(r'\\d+', c.strip()) is not None) for c in completions]\n"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return addition_task(tmp_path_factory.mktemp("addition"))


def config(task, objective, **keys) -> TrainConfig:
    """A few steps of LoRA on the addition task's tiny Llama (random weights), two workers, H = 2."""
    return TrainConfig.from_dict({
        "model": str(task / "model"), "data": str(task / objective.replace("orpo", "dpo")), "objective": objective,
        "fine_tune_type": "lora", "num_layers": -1, "lora_rank": 4, "workers": 2, "steps": 6, "sync_every": 2,
        "batch_size": 2, "group_size": 4, "max_completion_length": 5, "seq_len": 16, "eval_sequences": 8,
        "warmup": 1, "lr": 1e-2, "compress": "fp32", "beta": 0.04 if objective == "grpo" else -1,
        **({"reward_functions": "exact_answer,format", "reward_format": r"\d+"} if objective == "grpo" else {}),
        **keys})


# ---------------------------------------------------------------- the shards
@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_a_post_training_shard_holds_what_sim_reads_of_it(task, tmp_path, objective):
    """Each worker's shard gives the batches sim's worker draws from the whole data (across epochs),
    and the same held-out examples; GRPO's prompts come padded as sim pads them, with their answers
    and the held-out prompts. No tokenizer travels: a worker reads its model's."""
    c = config(task, objective, workers=3)
    spec = load_spec(c.model)
    data = load_data(c, spec, **QUIET)
    files = cut_shards(c, 3, tmp_path, **QUIET)
    assert not any(name.startswith("tokenizer") for shard in files.values() for name in shard)
    for w in range(3):
        shard = load_data(c, spec, shard_dir=tmp_path / f"worker-{w}")
        assert shard.is_shard and len(shard.train) == len(range(w, len(data.train), 3))
        read, shipped = ShardSampler(len(data.train), w, 3, seed=5), ShardSampler(len(shard.train), w, 3, 5, is_shard=True)
        for _ in range(6):
            ours, theirs = read.next_indices(4), shipped.next_indices(4)
            for a, b in zip(data.train.get(ours), shard.train.get(theirs)):
                if objective == "dpo":  # (GRPO's second part: the indices the rollouts look up)
                    np.testing.assert_array_equal(a, b)
            if objective == "grpo":
                np.testing.assert_array_equal(data.train.get(ours)[0], shard.train.get(theirs)[0])
                assert [(data.train.ids[i], data.train.prompts[i], data.train.answers[i]) for i in ours] == \
                    [(shard.train.ids[i], shard.train.prompts[i], shard.train.answers[i]) for i in theirs]
        for (x, y), (sx, sy) in zip(data.eval_batches(4, c.eval_sequences), shard.eval_batches(4, c.eval_sequences)):
            np.testing.assert_array_equal(x, sx)
            np.testing.assert_array_equal(y, sy)
        if objective == "grpo":
            assert shard.train.width == data.train.width
            assert (shard.held_out.ids, shard.held_out.answers) == (data.held_out.ids, data.held_out.answers)


def test_a_shard_of_a_model_folder_s_jsonl_carries_its_tokenizer_not_its_weights(tmp_path):
    """SFT on JSONL is tokenized by the model folder's tokenizer: a shard carries the tokenizer's files,
    never the model's weights (which every Mac loads from its own disk)."""
    model = tiny_llama_folder(tmp_path / "model")
    (tmp_path / "chat").mkdir()
    chat = lambda i: {"messages": [{"role": "user", "content": f"what is {i}?"}, {"role": "assistant", "content": f"{i}"}]}
    (tmp_path / "chat" / "train.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(40)))
    data = prepare(str(tmp_path / "chat"), 32, 0, str(model), mask_prompt=True, **QUIET)
    shard = load_shard(write_shard(data, 0, 2, tmp_path / "shard"))
    assert sorted(p.name for p in model.glob("*.safetensors")) and not list((tmp_path / "shard").rglob("*.safetensors"))
    assert (shard.tokenizer_dir / "tokenizer_config.json").read_text() == (model / "tokenizer_config.json").read_text()


# ---------------------------------------------------------------- launch on the emulated cluster
def sim_rows(c: TrainConfig, folder) -> list:
    Run(c, folder, SimCommunicator(c.workers), **QUIET).train()
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def rows_of(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def worker_adapters(cluster, slot: int) -> dict:
    (folder,) = cluster.folder.glob(f"host*/jobs/*/worker-{slot}")
    return {k: np.array(v) for k, v in mx.load(str(folder / "adapters" / "adapters.safetensors")).items()}


# What a cluster job's rows must equal of sim's (rank 0's rows, mirrored), to the cluster tests' tolerance.
SAME = {"grpo": ("eval_loss", "eval_accuracy", "eval_reward", "reward", "reward_workers", "reward_std",
                 "frac_reward_zero_std", "completion_length", "kl", "tokens_generated", "tokens_trained"),
        "dpo": ("eval_loss", "eval_pair_accuracy", "eval_logps_chosen", "eval_logps_rejected", "eval_reward_margin",
                "tokens_trained")}


# The ring adds the workers' values in another order than sim, and AdamW at lr 1e-2 makes a near-zero
# gradient's sign a full step: measured, GRPO's adapters after 6 steps, 1 of 256 values of a lora_a off
# by 4.4e-5 (the rows' metrics equal to 1e-4). Compared to about twice that.
ADAPTERS_ATOL = 1e-4


def assert_same_value(ours: dict, theirs: dict, key: str):
    """A row's `key` equal to sim's to the cluster tests' tolerance, or absent from both (the rollouts'
    keys and the tokens trained are not in the row of step 0, before any step)."""
    assert (key in ours) == (key in theirs) and (key in theirs or ours["step"] == 0), (ours["step"], key)
    if key in theirs:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (ours["step"], key)


@needs_namespaces
@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_launch_an_objective_on_two_hosts_trains_like_sim(task, tmp_path, objective):
    """`launch --objective` on a 2-host emulated cluster, the agents loading the model from their disk
    (--models-dir) and reading nothing else: the launcher ships each its shard, and every evaluation's
    metrics (GRPO's held-out accuracy, rewards, KL and tokens generated; DPO's pair accuracy and chosen
    log-probability) and the global adapters equal sim's with the same seed. The summary carries the
    objective's keys, and the launcher says what generating cost."""
    c = config(task, objective)
    cluster = EmulatedCluster(2, tmp_path / "cluster", models_dir=task, mdns=False)
    try:
        run_dir = tmp_path / "run"
        out = finish(launch(c, run_dir, f"--hosts={cluster.hosts_flag}"))
        expected = sim_rows(c, tmp_path / "sim")
        got = rows_of(run_dir)
        assert [r["step"] for r in got] == [r["step"] for r in expected] == [0, 2, 4, 6]
        for ours, theirs in zip(got, expected):
            for key in SAME[objective]:
                assert_same_value(ours, theirs, key)
        assert_same_params(worker_adapters(cluster, 0), {k: np.array(v) for k, v in mx.load(
            str(tmp_path / "sim" / "adapters" / "adapters.safetensors")).items()}, atol=ADAPTERS_ATOL)
        assert [e["event"] for e in events(run_dir)] == ["shipped"] * 2 + ["started"]
    finally:
        cluster.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    last = expected[-1]
    keys = {"grpo": ("tokens_generated", "tokens_trained", "generate_s", "train_s", "eval_accuracy"),
            "dpo": ("tokens_trained", "eval_pair_accuracy", "eval_logps_chosen")}[objective]
    assert all(summary[k] is not None for k in keys) and summary["time_s"]["generate_s"] > 0
    if objective == "grpo":
        assert summary["tokens_generated"] == last["tokens_generated"] and summary["generate_s"] > 0
        assert "post-training: held-out accuracy (greedy)" in out and "tokens generated" in out
    else:
        assert summary["eval_pair_accuracy"] == pytest.approx(last["eval_pair_accuracy"])
        assert "post-training: held-out pairs chosen over rejected" in out


@needs_namespaces
def test_a_shipped_reward_file_runs_where_the_agents_allow_code_and_trains_like_sim(task, tmp_path):
    """A reward file travels with the job (beside each worker's shard, as rewards.py), never read from
    a path on the agents' machines: where their owners allow code, the workers score with it as sim does."""
    reward = tmp_path / "my_rewards.py"
    reward.write_text(DIGITS)
    c = config(task, "grpo", reward_file=str(reward), reward_functions="digits", reward_format="", steps=4)
    cluster = EmulatedCluster(2, tmp_path / "cluster", models_dir=task, mdns=False, agent_flags=["--allow-code"])
    try:
        run_dir = tmp_path / "run"
        finish(launch(c, run_dir, f"--hosts={cluster.hosts_flag}"))
        jobs = [json.loads(p.read_text()) for p in cluster.folder.glob("host*/jobs/*/job.json")]
    finally:
        cluster.close()
    assert sorted(job["config"]["reward_file"].rsplit("/", 2)[-2:][1] for job in jobs) == ["rewards.py"] * 2
    assert all(job["config"]["reward_file"].startswith(str(cluster.folder)) for job in jobs)  # each agent's copy
    assert json.loads((run_dir / "launch.json").read_text())["config"]["reward_file"] == "rewards.py"
    expected = sim_rows(c, tmp_path / "sim")
    got = rows_of(run_dir)
    assert max(r["reward"] for r in got[1:]) > 0  # the file's rewards: a few completions were digits alone
    for ours, theirs in zip(got, expected):
        for key in ("eval_loss", "eval_reward", "reward", "reward_workers", "kl"):
            assert_same_value(ours, theirs, key)


def test_a_reward_file_where_an_agent_does_not_allow_code_is_refused_before_any_worker_starts(task, tmp_path):
    """Two agents, one of whose owners allows code from launches: a GRPO launch with a reward file is
    refused in one line naming the other agent and the option, before anything ships or any worker
    starts (the file runs on neither: the launcher alone loaded it, to check it); the same launch with
    built-in rewards trains there."""
    ran = tmp_path / "ran"  # each command that loads the reward file adds its name (launch, worker)
    reward = tmp_path / "rewards.py"
    reward.write_text(f"import sys\nwith open({str(ran)!r}, 'a') as f:\n    f.write(sys.argv[1] + '\\n')\n" + DIGITS)
    for name in "ab":
        (tmp_path / name).mkdir()
    owners = [LiveAgent(tmp_path / "a", "--models-dir", task, "--allow-code"), LiveAgent(tmp_path / "b", "--models-dir", task)]
    hosts = ",".join(f"127.0.0.1:{a.port}" for a in owners)
    env = {"MLX_DILOCO_SECRET": LIVE_SECRET}
    c = config(task, "grpo", reward_file=str(reward), reward_functions="digits", reward_format="", steps=2)
    try:
        out = run_cli("launch", *config_flags(c), "--hosts", hosts, "--run-dir", tmp_path / "run", env=env)
        job = json.loads((tmp_path / "run" / "launch.json").read_text())["job"]
        states = [a.client.request("status", job=job, metrics_from=0, exchanges_from=protocol.NO_LOG,
                                   log_from=protocol.NO_LOG)["state"] for a in owners]
        assert out.returncode == 2, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1] == (
            f"mlx-diloco: error: job failed: agent at 127.0.0.1:{owners[1].port} refused 'start': reward file "
            "'rewards.py' is Python code, which this agent runs only when started with --allow-code")
        assert states == ["unknown", "unknown"]  # no worker started, on either machine
        assert not any(any((a.state / "blobs").iterdir()) for a in owners)  # nothing shipped
        built_in = config(task, "grpo", steps=2)
        out = run_cli("launch", *config_flags(built_in), "--hosts", hosts, "--run-dir", tmp_path / "built-in", env=env)
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        for a in owners:
            a.close()
    assert ran.read_text().split() == ["launch"]  # the launcher checked it; no worker ran it
    assert rows_of(tmp_path / "built-in")[-1]["objective"] == "grpo"


# ---------------------------------------------------------------- elastic membership
@needs_namespaces
def test_a_grpo_worker_that_leaves_mid_round_loses_only_its_own_round(task, tmp_path):
    """Elastic membership with GRPO: on three hosts, worker 2 leaves at step 4, mid-round (H = 2: it
    took step 3 of the round that ends at 4), and joins again at the sync at step 6. Only its round is
    lost (inner_steps_lost [0, 0, 1]); the others redo no step; the global adapters and every row's
    held-out accuracy, reward and loss equal sim's replaying the same schedule, and so do the rollouts'
    reward and KL where the ring held every worker since the evaluation before (steps 2 and 8: after
    a change the cluster's rows count the ring's workers, where sim's also count the leaver's lost
    round)."""
    c = config(task, "grpo", workers=3, steps=8, membership="0:3,4:2,5:3")
    cluster = EmulatedCluster(3, tmp_path / "cluster", models_dir=task, mdns=False)
    try:
        run_dir = tmp_path / "run"
        finish(launch(c, run_dir, f"--hosts={cluster.hosts_flag}"))
        got_adapters = worker_adapters(cluster, 0)
    finally:
        cluster.close()
    kinds = [(e["event"], e.get("worker")) for e in events(run_dir) if e["event"] in ("left", "joined")]
    assert kinds == [("left", 2), ("joined", 2)]
    changes = [e["redone_steps"] for e in events(run_dir) if e["event"] == "membership_change"]
    assert changes == [{"0": 0, "1": 0}, {"0": 0, "1": 0}]
    expected = sim_rows(c, tmp_path / "sim")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["inner_steps_lost"] == expected[-1]["inner_steps_lost"] == [0, 0, 1]
    assert_same_params(got_adapters, {k: np.array(v) for k, v in mx.load(
        str(tmp_path / "sim" / "adapters" / "adapters.safetensors")).items()}, atol=MEMBERSHIP_ATOL)
    got = rows_of(run_dir)
    assert [(r["step"], r["members"]) for r in got] == [(r["step"], r["members"]) for r in expected] == \
        [(0, 3), (2, 3), (4, 2), (6, 2), (8, 3)]
    for ours, theirs in zip(got, expected):
        for key in ("eval_loss", "eval_accuracy", "eval_reward") + (("reward", "kl") if ours["step"] in (2, 8) else ()):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3, abs=MEMBERSHIP_ATOL), (ours["step"], key)
    generated = [r["tokens_generated"] for r in got[1:]]
    assert generated == sorted(generated) and summary["tokens_generated"] == generated[-1] > 0
