import pytest

from conftest import run_cli
from mlx_diloco.exchange.network import LINKS, all_reduce_time, parse_link
from mlx_diloco.tools.plan import plan


def test_seed_blog_sync_times():
    """7B fp16 (14 GB): ~0.56 s at 200 Gbit/s, ~20 min at 100 Mbit/s (2 workers)."""
    fast = all_reduce_time(14e9, 2, parse_link("200gbit"))
    slow = all_reduce_time(14e9, 2, parse_link("100mbit"))
    assert fast == pytest.approx(0.56, rel=0.01)
    assert 17 * 60 < slow < 21 * 60


def test_blog_training_times():
    """1000 batches of 1 min: 2 GPUs over a data center 505 min; DiLoCo H=500 over internet 520 min."""
    dc, home = plan(7e9, "fp16", 2, 500, 60.0, [LINKS["datacenter"], parse_link("100mbit")], 1000)
    assert dc["ddp_s"] / 60 == pytest.approx(505, rel=0.01)
    assert home["diloco_s"] / 60 == pytest.approx(520, rel=0.01)
    assert home["diloco_util"] > 0.95 > 0.1 > home["ddp_util"]


def test_link_parsing():
    link = parse_link("100mbit/20ms")
    assert link.bandwidth_bps == 100e6 and link.latency_s == pytest.approx(0.02)
    with pytest.raises(ValueError, match="unknown link"):
        parse_link("carrier-pigeon")


def test_plan_cli():
    out = run_cli("plan", "--params", "7B", "--link", "200gbit", "--link", "internet")
    assert out.returncode == 0 and "560 ms" in out.stdout and "min" in out.stdout
    out = run_cli("plan", "--params", "1B", "--compress", "int4", "--fragments", "4", "--overlap-steps", "5",
                  "--workers", "8", "--step-time", "1", "--sync-every", "100", "--link", "internet")
    assert out.returncode == 0 and "0.531 bytes/parameter" in out.stdout and "quantized ring" in out.stdout


def test_streaming_overlap_hides_what_it_can():
    """A fragment's exchange is hidden when tau steps of compute outlast it."""
    link = parse_link("100mbit")
    (plain,) = plan(100e6, "fp16", 2, 100, 1.0, [link])
    (streamed,) = plan(100e6, "int4", 2, 100, 1.0, [link], fragments=4, overlap_steps=5)
    assert plain["diloco_util"] < 0.9 and streamed["fragment_s"] < 5 and streamed["diloco_util"] == 1.0
