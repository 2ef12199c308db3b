"""A membership schedule (issue 24): the simulator replays workers leaving and joining mid-run.
A leaver's round is lost, a joiner starts from the global model and a member's moments at the next
sync, every sync weighs the members by the steps they took, and a non-member's shard waits."""

import math
import re

import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import run_cli, tiny_config
from mlx_diloco.config import ConfigError, TrainConfig
from mlx_diloco.exchange.comm import SimCommunicator
from mlx_diloco.schedules.membership import Change, Schedule, Timeline
from mlx_diloco.strategies.fragments import gather
from mlx_diloco.training import checkpoint
from mlx_diloco.training.metrics import MetricsLog
from mlx_diloco.training.resolve import resolve
from mlx_diloco.training.run import Run

# 4 slots, H = 4: worker 3 leaves at step 6, mid-round (it took step 5), and the rise at step 9
# admits it after the sync at step 12.
SCHEDULE = "0:4,6:3,9:4"
TINY_FLAGS = ["--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--eval-sequences", "8", "--warmup", "2"]


def config(**overrides):
    return tiny_config(**{"workers": 4, "steps": 16, "membership": SCHEDULE, **overrides})


def run_of(cfg, folder, said=None):
    return Run(cfg, folder, SimCommunicator(cfg.workers), log=(said.append if said is not None else lambda m: None))


def step_to(run, step: int):
    while run.steps_done < step:
        run.step()


def arrays(tree) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def test_schedules_are_checked_in_one_line(tmp_path):
    for text, workers, message in [
            ("0:4,x", 4, "STEP:WORKERS pairs separated by commas"), ("0:4,10:0", 4, "at least 1 worker"),
            ("0:4,10:3,9:4", 4, "steps must not decrease"), ("0:4,10:3", 3, "set --workers 4"),
            ("0:2,10:3", 4, "set --workers 3")]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_dict(dict(workers=workers, membership=text))
    assert Schedule.of(TrainConfig.from_dict(dict(workers=4, membership="10:3"))).entries == ((0, 4), (10, 3))
    with pytest.raises(ConfigError, match="cannot be combined with worker-speeds"):
        TrainConfig.from_dict(dict(workers=2, membership="0:2,4:1", worker_speeds="1,0.5"))
    for options, message in [(dict(strategy="ddp"), "exchanges only at its syncs"),
                             (dict(ddp_warmup_steps=2), "exchanges only at its syncs"),
                             (dict(fragments=2, overlap_steps=1), "exchange in flight (overlap-steps) kept"),
                             (dict(compress="int8", error_feedback=True), "compression lost (error-feedback) kept"),
                             (dict(strategy="quorum"), "which quorum has not (its outer steps come when workers report)")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve(config(**options))
    out = run_cli("sim", *TINY_FLAGS, "--workers", "3", "--membership", "0:4,8:3", "--run-dir", tmp_path / "r")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].endswith("set --workers 4 (the largest "
                                                                                  "count in the schedule)")


def test_a_timeline_admits_at_the_next_sync_and_weighs_by_steps():
    """Two fragments, H = 4 (offsets 2 and 0): a fragment syncs every 2 steps, so the rise at
    step 7 admits worker 3 after step 8; the sync at step 10 covers steps 7..10, 2 of them its."""
    t = Timeline(Schedule(((0, 4), (5, 3), (7, 4))), sync_every=4, offsets=[2, 0], steps=12)
    assert [t.count(s) for s in (0, 4, 5, 8, 9)] == [4, 4, 3, 3, 4] and t.members(5) == {0, 1, 2}
    left, joined = t.changes
    # fragment 0 last synced at step 2, fragment 1 at 4: steps 3 and 4 are partly lost
    assert (left.step, left.worker, left.lost_steps, left.since) == (5, 3, 2, 2)
    assert (joined.step, joined.worker, joined.joined) == (8, 3, True)
    assert t.steps_taken(12) == [12, 12, 12, 8] and t.lost_steps(12) == [0, 0, 0, 2]
    assert t.sync_weights(9) is None and t.sync_weights(8) == {0: [4 * 4 / 12] * 3 + [0]}
    assert t.sync_weights(10) == {2: [4 * 4 / 14] * 3 + [4 * 2 / 14]}
    whole = Timeline(Schedule(((0, 4), (6, 3))), sync_every=4, offsets=[0], steps=12)
    assert whole.changes[0].lost_steps == 1 and whole.changes[0].since == 4 and whole.steps_taken(12)[3] == 5
    # At the last step both fragments sync, each over its own window (steps 9..12 and 11..12): a
    # joiner admitted at step 10 weighs 2 steps of 4 in one, 2 of 2 in the other. A leaver weighs 0 in both.
    last = Timeline(Schedule(((0, 3), (9, 4))), sync_every=4, offsets=[2, 0], steps=12).sync_weights(12)
    assert last == {0: [4 * 4 / 14] * 3 + [4 * 2 / 14], 2: [1.0] * 4}
    assert Timeline(Schedule(((0, 4), (11, 3))), sync_every=4, offsets=[2, 0], steps=12).sync_weights(12) == \
        {0: [4 / 3] * 3 + [0], 2: [4 / 3] * 3 + [0]}


def test_a_named_slot_leaves_mid_round_and_rejoins_from_the_lowest_numbered_member():
    """H = 4, 4 slots: slot 1 leaves at step 6 (it took step 5), slot 0 at step 10; slot 1 asks to
    join at step 9 and is admitted after the sync at 12 with slot 2's moments (slot 0 has left), slot
    0 asks at 14 and is admitted after the sync at 16."""
    schedule = Schedule.from_text("6:-1,9:+1,10:-0,14:+0", workers=4)
    assert schedule.text == "0:4,6:-1,9:+1,10:-0,14:+0"
    t = Timeline(schedule, sync_every=4, offsets=[0], steps=20)
    assert [t.members(s) for s in (0, 5, 6, 9, 10, 12, 13, 16, 17)] == \
        [{0, 1, 2, 3}] * 2 + [{0, 2, 3}] * 2 + [{2, 3}] * 2 + [{1, 2, 3}] * 2 + [{0, 1, 2, 3}]
    assert [t.count(s) for s in (6, 10, 13)] == [3, 2, 3]
    assert t.changes == [Change(6, 1, False, 3, lost_steps=1, since=4), Change(10, 0, False, 2, lost_steps=1, since=8),
                         Change(12, 1, True, 3), Change(16, 0, True, 4)]
    assert [t.peer(s) for s in (5, 8, 12, 16)] == [0, 0, 2, 1]
    # each sync weighs the slots by their steps in its window, 0 for a slot that is not a member then
    assert [t.sync_weights(s) for s in (8, 12, 16, 20)] == [{0: [4 / 3, 0, 4 / 3, 4 / 3]}, {0: [0, 0, 2, 2]},
                                                            {0: [0, 4 / 3, 4 / 3, 4 / 3]}, {0: [1, 1, 1, 1]}]
    assert t.steps_taken(20) == [9 + 4, 5 + 8, 20, 20] and t.lost_steps(20) == [1, 1, 0, 0]
    assert t.lost_steps(9) == [0, 1, 0, 0]


def test_entries_at_one_step_apply_in_order_and_counts_name_the_slots():
    both = Timeline(Schedule.from_text("0:4,6:-1,6:-2,9:+2,9:+1", 4), sync_every=4, offsets=[0], steps=16)
    assert [c.row() for c in both.changes] == [
        {"step": 6, "worker": 1, "event": "left", "members": 3, "lost_steps": 1, "since": 4},
        {"step": 6, "worker": 2, "event": "left", "members": 2, "lost_steps": 1, "since": 4},
        {"step": 12, "worker": 2, "event": "joined", "members": 4}, {"step": 12, "worker": 1, "event": "joined",
                                                                    "members": 4}]
    assert both.sync_weights(12) == {0: [2, 0, 0, 2]} and both.steps_taken(16) == [16, 9, 9, 16]
    # A rise brings the lowest-numbered free slots, a drop takes the highest-numbered members.
    rise = Timeline(Schedule.from_text("0:4,6:-1,9:4", 4), sync_every=4, offsets=[0], steps=16)
    assert rise.members(13) == {0, 1, 2, 3} and [c.worker for c in rise.changes] == [1, 1]
    drop = Timeline(Schedule.from_text("0:4,6:-0,9:2", 4), sync_every=4, offsets=[0], steps=16)
    assert drop.members(9) == {1, 2} and drop.peer(9) == 1
    # Slot 1 absent from the start; slot 3 asks to join at 5 but leaves at 6, before the sync at 8 admits it.
    late = Timeline(Schedule.from_text("0:-1,0:2,5:+3,6:-3,7:+1", 4), sync_every=4, offsets=[0], steps=16)
    assert late.members(0) == {0, 2} and late.changes == [Change(8, 1, True, 3)] and late.steps_taken(16)[3] == 0


@pytest.mark.parametrize("text, workers, message", [
    ("0:4,6:-1,7:-1", 4, "slot 1 leaves at step 7 but is not a member then"),
    ("0:4,6:-1,7:+1,8:+1", 4, "slot 1 joins at step 8 but is a member then or joining already"),
    ("6:+1", 4, "slot 1 joins at step 6 but is a member then"),
    ("6:-4", 4, r"names slot 4 but --workers is 4 \(slots 0..3\); set --workers 5 or more"),
    ("0:4,6:-1,9:5", 4, "has up to 5 members but --workers is 4; set --workers 5 or more"),
    ("0:2,6:-0,6:-1", 2, "leaves no worker at step 6"),
    ("6:-1,6:x", 4, "STEP:WORKERS pairs separated by commas, or STEP:-SLOT and STEP:\\+SLOT"),
    ("6:-1,5:+1", 4, "steps must not decrease")])
def test_a_misused_named_entry_is_one_line(text, workers, message):
    with pytest.raises(ConfigError, match=message) as error:
        TrainConfig.from_dict(dict(workers=workers, membership=text))
    assert "\n" not in str(error.value)


def test_a_timeline_without_a_member_until_a_sync_is_one_line():
    """Slots 0 and 1 leave at step 11; slot 2 could take over only after the sync at 12."""
    with pytest.raises(ConfigError, match="leaves no worker at step 11"):
        Timeline(Schedule.from_text("0:2,10:+2,11:-0,11:-1", 3), sync_every=4, offsets=[0], steps=16)


def test_a_leaver_loses_its_round_and_a_joiner_starts_from_the_global_model(tmp_path):
    said = []
    run = run_of(config(compress="fp32", outer_lr=0.7, outer_momentum=0.9), tmp_path / "r", said)
    fragment = run.strategy.model_fragments[0]
    # (a) the sync at step 8 is the outer step on the 3 survivors' mean pseudo-gradient (numpy)
    step_to(run, 5)
    cursor = run.samplers[3].state()
    step_to(run, 7)
    tick = run.inner_step()  # step 8's inner step; its end_step syncs
    local = np.array(gather(dict(tree_flatten(run.workers.params)), fragment.pieces))
    before, momentum = np.array(fragment.global_values), np.array(fragment.store.outer_state["p"]["v"])
    run.end_step(tick)

    def outer_step(mean_delta):  # Nesterov SGD, outer lr 0.7, momentum 0.9
        v = 0.9 * momentum + mean_delta
        return before - 0.7 * (mean_delta + 0.9 * v)
    survivors, everyone = outer_step((before - local[:3]).mean(0)), outer_step((before - local).mean(0))
    after = np.array(fragment.global_values)
    assert np.allclose(after, survivors, rtol=0, atol=1e-6)
    assert not np.allclose(after, everyone, rtol=0, atol=1e-4)  # the leaver's stale replica would show
    # (c) the non-member's shard waits
    step_to(run, 11)
    assert run.samplers[3].state() == cursor and run.samplers[0].state() != cursor
    moments = {k: v for k, v in arrays(run.workers.optimizer.state).items() if v.ndim}
    assert any(not np.array_equal(v[3], v[0]) for v in moments.values())
    # (b) admitted after the sync at step 12: the global model, and worker 0's moments
    run.step()
    params = arrays(run.workers.params)
    assert all(np.array_equal(params[k][3], v) for k, v in arrays(run.global_params()).items())
    assert all(np.array_equal(v[3], v[0]) for k, v in arrays(run.workers.optimizer.state).items() if v.ndim)
    run.step()
    assert run.samplers[3].state() != cursor  # it steps from step 13
    summary = run.train()
    # (d) tokens per shard (worker 3 took steps 1..5 and 13..16), steps lost, the rows and the log
    per_step = 4 * 16
    assert summary["tokens_per_shard"] == [16 * per_step] * 3 + [9 * per_step]
    assert summary["tokens"] == sum(summary["tokens_per_shard"]) and summary["inner_steps_lost"] == [0, 0, 0, 1]
    rows = {r["step"]: r for r in MetricsLog.read(tmp_path / "r")}
    assert math.isnan(rows[8]["eval_loss_workers"][3]) and not math.isnan(rows[8]["eval_loss_workers"][2])
    assert math.isnan(rows[12]["train_loss_workers"][3]) and not math.isnan(rows[12]["train_loss"])
    assert [r["members"] for r in rows.values()] == [4, 4, 3, 3, 4]
    assert rows[8]["membership_changes"] == [{"step": 6, "worker": 3, "event": "left", "members": 3,
                                              "lost_steps": 1, "since": 4}]
    assert rows[12]["membership_changes"] == [{"step": 12, "worker": 3, "event": "joined", "members": 4}]
    assert "step 6: worker 3 left (its 1 inner step since step 4 is lost); 3 workers" in said
    assert "step 12: worker 3 joined from the global model; 4 workers" in said


def test_a_named_leaver_rejoins_with_the_lowest_numbered_members_moments(tmp_path):
    """Slot 1 leaves at step 6, slot 0 at step 10: slot 1, admitted after the sync at 12, takes
    slot 2's moments."""
    run = run_of(config(membership="0:4,6:-1,9:+1,10:-0"), tmp_path / "n")
    step_to(run, 5)
    cursor = run.samplers[1].state()
    step_to(run, 11)
    assert run.pacing.members(11) == [False, False, True, True] and run.samplers[1].state() == cursor
    run.step()
    params, moments = arrays(run.workers.params), {k: v for k, v in arrays(run.workers.optimizer.state).items()
                                                   if v.ndim}
    assert all(np.array_equal(params[k][1], v) for k, v in arrays(run.global_params()).items())
    assert all(np.array_equal(v[1], v[2]) for v in moments.values())
    assert any(not np.array_equal(v[1], v[0]) for v in moments.values())
    summary = run.train()
    assert summary["tokens_per_shard"] == [9 * 64, 9 * 64, 16 * 64, 16 * 64]
    assert summary["inner_steps_lost"] == [1, 1, 0, 0]


def test_two_fragments_admit_a_joiner_with_every_fragments_global_values(tmp_path):
    run = run_of(config(fragments=2, steps=12, membership="0:4,5:3,7:4"), tmp_path / "f")
    step_to(run, 8)
    params, global_model = arrays(run.workers.params), arrays(run.global_params())
    assert all(np.array_equal(params[k][3], v) for k, v in global_model.items())
    assert any(not np.array_equal(params[k][0], v) for k, v in global_model.items())  # members hold their own
    step_to(run, 10)  # fragment 0's sync: steps 7..10, worker 3 took 9 and 10
    assert run.pacing.inputs_at(10).sync_weights[2] == pytest.approx([16 / 14] * 3 + [8 / 14])
    summary = run.train()
    assert summary["tokens_per_shard"] == [12 * 64] * 3 + [8 * 64] and math.isfinite(summary["final_eval_loss"])


def test_a_run_with_a_schedule_resumes_exactly(tmp_path):
    whole = run_of(config(), tmp_path / "whole").train()
    run_of(config(), tmp_path / "cut").train(stop_after=8)
    said = []
    resumed = Run(None, tmp_path / "cut", SimCommunicator(4), resume=True, log=said.append).train()
    assert resumed["final_eval_loss"] == whole["final_eval_loss"]
    assert resumed["tokens_per_shard"] == whole["tokens_per_shard"]
    assert not any("left" in m for m in said) and any("worker 3 joined" in m for m in said)


def test_two_processes_replay_the_schedule_as_one(tmp_path):
    """Worker 3 lives in the second process, worker 0 (whose moments it takes) in the first. fp32
    exchanges: with or without a schedule, 1 and 2 processes then differ by 1.2e-7 at most."""
    one = run_of(config(compress="fp32"), tmp_path / "one")
    one.train()
    out = run_cli("sim", *TINY_FLAGS, "--workers", "4", "--steps", "16", "--sync-every", "4", "--membership",
                  SCHEDULE, "--compress", "fp32", "--processes", "2", "--sample-tokens", "0",
                  "--run-dir", tmp_path / "two")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("worker 3 left") == 1 and out.stderr.count("worker 3 joined") == 1
    arrays_two, _ = checkpoint.load(tmp_path / "two", log=lambda m: None)
    two = np.array(arrays_two["strategy"]["fragments"][0]["global"])
    assert np.allclose(two, np.array(one.strategy.model_fragments[0].global_values), rtol=0, atol=1e-6)
