"""`mlx-diloco plan`: what-if estimates of sync time and utilisation for any model, link and H."""

from .metrics import human_bytes
from .network import LINKS, all_reduce_time, parse_link

BYTES_PER = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int4": 0.5}


def plan(params: float, dtype: str, workers: int, sync_every: int, step_time: float,
         links: list, total_steps: int = None) -> list:
    """One row per link: sync time and compute utilisation of DDP and DiLoCo."""
    payload = params * BYTES_PER[dtype]
    rows = []
    for link in links:
        sync = all_reduce_time(payload, workers, link)
        row = {"link": link.describe(), "sync_s": sync,
               "ddp_util": step_time / (step_time + sync),
               "diloco_util": sync_every * step_time / (sync_every * step_time + sync)}
        if total_steps:
            per_worker = total_steps / workers
            row["single_s"] = total_steps * step_time
            row["ddp_s"] = per_worker * (step_time + sync)
            row["diloco_s"] = per_worker * step_time + per_worker / sync_every * sync
        rows.append(row)
    return rows


def format_duration(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    if s < 3 * 86400:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} days"


def print_plan(args):
    links = [parse_link(l) for l in args.link] if args.link else list(LINKS.values())
    rows = plan(args.params, args.dtype, args.workers, args.sync_every, args.step_time, links, args.total_steps)
    payload = args.params * BYTES_PER[args.dtype]
    print(f"model {args.params / 1e9:g}B parameters in {args.dtype} = {human_bytes(payload)} per sync; "
          f"{args.workers} workers, ring all-reduce, step time {format_duration(args.step_time)}, H = {args.sync_every}")
    head = f"{'link':34} {'sync time':>11} {'DDP util':>9} {'DiLoCo util':>12}"
    if args.total_steps:
        head += f" {'single':>11} {'DDP':>11} {'DiLoCo':>11}"
    print(head)
    for r in rows:
        line = f"{r['link']:34} {format_duration(r['sync_s']):>11} {r['ddp_util']:>9.1%} {r['diloco_util']:>12.1%}"
        if args.total_steps:
            line += "".join(f" {format_duration(r[k]):>11}" for k in ("single_s", "ddp_s", "diloco_s"))
        print(line)
