"""Choosing H (issue 44): `--sync-every auto` takes the smallest sync period whose exchanges stay
within 5% of the wall-clock for the run's link, step time and payload; the start line says H, that
share and the outer steps; a run of few outer steps for its M says what the grid measured; `plan`
prints what auto takes on each link."""

import json

import pytest

from conftest import run_cli
from mlx_diloco.schedules.sync_period import EXPOSED_BUDGET, LADDER, SyncCost, choose_sync_every


def test_auto_is_the_smallest_h_of_the_ladder_within_the_budget():
    cost = SyncCost(exchange_s=1.0, step_s=0.1)            # a sync costs 10 steps: H >= 190 for 5%
    H = choose_sync_every(cost)
    assert H == 200 and cost.share(H) <= EXPOSED_BUDGET < cost.share(LADDER[LADDER.index(H) - 1])
    hidden = SyncCost(exchange_s=1.0, step_s=0.1, overlap_steps=10)  # streaming: the overlap hides it all
    assert hidden.share(5) == 0 and choose_sync_every(hidden, minimum=11) == 15
    assert choose_sync_every(SyncCost(exchange_s=1e6, step_s=0.1)) == LADDER[-1]  # none fits: the largest


def test_sim_takes_auto_says_why_and_records_the_number(tmp_path):
    # tiny (42K values in fp16, 84 KB a sync) over 2 workers on 10 Mbit/s, 0.01 s a step: H in the hundreds
    out = run_cli("sim", "--model", "tiny", "--seq-len", "16", "--batch-size", "4", "--workers", "2",
                  "--steps", "400", "--sync-every", "auto", "--link", "10mbit", "--step-time", "0.01",
                  "--eval-sequences", "8", "--sample-tokens", "0", "--processes", "1", "--run-dir", tmp_path / "r")
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout + out.stderr
    line = next(l for l in said.splitlines() if l.startswith("H=") and "(auto)" in l)
    H, exchange_s = int(line.split()[0][2:]), float(line.split("exchange takes ")[1].split()[0])
    cost = SyncCost(exchange_s, 0.01)
    assert exchange_s > 0.05 and H == choose_sync_every(cost)  # the smallest H of the ladder within budget
    assert cost.share(H) <= EXPOSED_BUDGET < cost.share(LADDER[LADDER.index(H) - 1])
    assert f"{cost.share(H):.1%} of the wall-clock" in line and f"{400 / H:.0f} outer steps in 400 steps" in line
    assert json.loads((tmp_path / "r" / "config.json").read_text())["sync_every"] == H
    assert "outer steps are few for M=2" in said  # and what would do better


def test_a_bad_value_is_one_line():
    bad = run_cli("sim", "--sync-every", "often")
    assert bad.returncode == 2 and "'often' is neither a whole number nor auto" in bad.stderr


def test_plan_prints_what_auto_takes_on_each_link():
    out = run_cli("plan", "--model", "small", "--workers", "4", "--step-time", "0.2", "--total-steps", "2000")
    assert out.returncode == 0, out.stderr[-2000:]
    wifi = next(l for l in out.stdout.splitlines() if l.startswith("Wi-Fi"))
    assert "auto H" in out.stdout and wifi.split("%")[-1].split()[:2] == ["15", "33"]  # 0.157 s a sync, 0.2 s a step
