"""Issue 25's measured links on the emulated cluster: `mlx-diloco links` over 4 hosts whose Ethernet
(the bridge) is shaped to 100 Mbit/s and whose four "Thunderbolt" cables (direct links, 1-3, 3-2,
2-4, 4-1: a ring not in the hosts' order) to 1 Gbit/s, with tc's tbf. Reported: each pair's kind,
all-reduce bus bandwidth, send/recv bandwidth and latency against the shaping rate; the ring the
measurements choose; what `plan --cluster` takes as its link; and a plot of bandwidth against
message size per pair (bench/results/links.png).

    sudo .venv/bin/python bench/links.py            # about 1 minute on a 2-core machine
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

ETHERNET, THUNDERBOLT = 0.1, 1.0  # Gbit/s the bridge and the cables are shaped to
CABLES = [(1, 3), (2, 3), (2, 4), (1, 4)]


def cli(*args) -> str:
    from mlx_diloco.cluster.emulated import SECRET
    result = subprocess.run([sys.executable, "-m", "mlx_diloco", *map(str, args)], capture_output=True, text=True,
                            env={**os.environ, "MLX_DILOCO_SECRET": SECRET}, timeout=1200)
    if result.returncode != 0:
        raise SystemExit(f"mlx-diloco {args[0]} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def plot(pairs: list, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {"thunderbolt": "tab:blue", "ethernet": "tab:orange"}
    for ax, op, title in ((axes[0], "all_reduce", "all-reduce (bus bandwidth)"),
                          (axes[1], "send_recv", "send/recv (slower direction)")):
        for k, p in enumerate(pairs):
            sizes = sorted({r["bytes"] for r in p["rows"]})
            gbps = [min(r["busbw_gbps"] for r in p["rows"] if r["op"] == op and r["bytes"] == n) for n in sizes]
            ax.plot(sizes, gbps, marker="o", ms=3, color=colors.get(p["kind"], "gray"), alpha=0.8,
                    linestyle=("-", "--", ":")[k % 3], label=f"{' - '.join(p['hosts'])} ({p['kind']})")
        for rate, kind in ((THUNDERBOLT, "thunderbolt"), (ETHERNET, "ethernet")):
            ax.axhline(rate, color=colors[kind], linewidth=0.8, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("Gbit/s (lines: the shaping rates)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("mlx-diloco links on 4 emulated hosts: Ethernet shaped to 100 Mbit/s, cables to 1 Gbit/s (tbf; "
                 "messages under its bucket pass faster)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-size", default="64MB", help="largest message (links --max-size)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "links.txt"))
    args = p.parse_args()
    ensure_fast_blas([__file__, *sys.argv[1:]])
    from cluster_links import doctor_gflops, save_table
    from mlx_diloco.cluster.emulated import EmulatedCluster, can_build
    if why := can_build():
        raise SystemExit(f"cannot build the emulated cluster: {why}")
    gflops = doctor_gflops()
    lines = [f"command: sudo .venv/bin/python bench/{Path(__file__).name} {' '.join(sys.argv[1:])}".rstrip(),
             f"doctor: {gflops}", f"load average before: {os.getloadavg()[0]:.2f}"]
    print(lines[0], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EmulatedCluster(4, Path(tmp) / "cluster", rate="100mbit", cables={c: "1gbit" for c in CABLES}, mdns=False)
        try:
            start = time.time()
            table = cli("links", f"--hosts={cluster.hosts_flag}", f"--max-size={args.max_size}",
                        "--out", Path(tmp) / "links.json")
            took = time.time() - start
            measured = json.loads((Path(tmp) / "links.json").read_text())
            plan = cli("plan", "--cluster", f"--hosts={cluster.hosts_flag}", "--params=124M")
        finally:
            cluster.close()
    lines += [f"mlx-diloco links --max-size {args.max_size}: {len(measured['pairs'])} pairs in {took:.0f} s "
              f"(load average after: {os.getloadavg()[0]:.2f})", *table.rstrip().splitlines(), ""]
    lines.append(f"{'pair':16} {'kind':12} {'shaped':>8} {'all-reduce':>11} {'ratio':>6} {'send/recv':>10} {'ratio':>6}")
    for pair in measured["pairs"]:
        rate = THUNDERBOLT if pair["kind"] == "thunderbolt" else ETHERNET
        lines.append(f"{' - '.join(pair['hosts']):16} {pair['kind']:12} {rate:>8g} {pair['gbps']:>11.3f} "
                     f"{pair['gbps'] / rate:>6.1%} {pair['sendrecv_gbps']:>10.3f} {pair['sendrecv_gbps'] / rate:>6.1%}")
    lines.append("(Gbit/s; the ratio to the shaping rate: tbf counts Ethernet, IP and TCP headers, 4.4% of a "
                 "1514-byte frame)")
    lines += ["plan --cluster --params 124M (the slowest hop of that ring as its link):",
              *[f"  {l}" for l in plan.splitlines() if l.startswith(("link ", "measured"))]]
    lines.append("")
    lines.append("per size, one pair of each kind (busbw Gbit/s, time):")
    for kind in ("thunderbolt", "ethernet"):
        pair = next(p for p in measured["pairs"] if p["kind"] == kind)
        lines.append(f"  {' - '.join(pair['hosts'])} ({kind})")
        for n in sorted({r["bytes"] for r in pair["rows"]}):
            at = {(r["op"], r["from"]): r for r in pair["rows"] if r["bytes"] == n}
            lines.append(f"    {n:>10,} B  all-reduce {at[('all_reduce', None)]['busbw_gbps']:7.3f} "
                         f"({at[('all_reduce', None)]['seconds'] * 1e3:8.2f} ms)  send/recv "
                         f"{at[('send_recv', 0)]['busbw_gbps']:7.3f} / {at[('send_recv', 1)]['busbw_gbps']:7.3f}")
    lines.append("Sizes below tbf's bucket (64 KB at 100 Mbit/s, 625 KB at 1 Gbit/s) pass at the veth's speed: a "
                 "bandwidth above the shaping rate there is the emulation's, not a link's (a link's figures come "
                 "from the two largest sizes).")
    out_png = Path(args.out).with_suffix(".png")
    plot(measured["pairs"], out_png)
    lines.append(f"plot: {out_png.relative_to(ROOT) if out_png.is_relative_to(ROOT) else out_png}")
    save_table(lines, args.out)


if __name__ == "__main__":
    main()
