"""`mlx-diloco plan`: what-if estimates of sync time and utilisation for any model, link and H,
codec, number of fragments (Streaming DiLoCo) and overlap; with --model, memory per worker too
(memory.py's estimates: this module prints them)."""

from dataclasses import replace

from ..cluster import hostinfo
from ..config import DEFAULT_MAX_SEQ_LEN, TrainConfig
from ..exchange.codecs import get_codec
from ..exchange.comm import exchange_plan
from ..exchange.network import LINKS, Link, exchange_time, parse_link
from ..machine.memory import (GB, GPU_SHARE, MAC_MEMORY_GB, MemoryOptions, estimate, flags, macs_it_fits, make_it_fit,
                     on_this_machine, trained_shape)
from ..schedules.sync_period import EXPOSED_BUDGET, SyncCost, choose_sync_every
from ..strategies import make_strategy
from ..training.metrics import human_bytes

# plan's flags are config keys and DiLoCo's options (their help from their fields, cli.py), with
# what-if defaults of its own where sim's would not say much: a pair of machines, a large H, and
# the minute a step of a large model takes.
STRATEGY = "diloco"  # plan's columns set DDP beside (Streaming) DiLoCo
FLAGS = ("batch_size", "seq_len", "precision", "moments_precision", "grad_checkpoint", "offload_outer",
         "compress", "fragments", "overlap_steps", "workers", "sync_every", "step_time",
         "fine_tune_type", "num_layers", "lora_rank", "objective", "group_size", "max_completion_length")
WHAT_IF = {"workers": 2, "sync_every": 500, "step_time": 60.0}


def plan(params: float, codec: str, workers: int, sync_every: int, step_time: float, links: list,
         total_steps: int = None, fragments: int = 1, overlap_steps: int = 0) -> list:
    """One row per link: sync time and compute utilisation of DDP and (Streaming) DiLoCo. DiLoCo
    exchanges P fragments every H steps; each one's time beyond `overlap_steps` of compute is exposed."""
    codec = get_codec(codec)
    _, hops, _, sent = exchange_plan(codec, int(params), workers)
    _, frag_hops, _, frag_sent = exchange_plan(codec, int(params) // fragments, workers)
    rows = []
    for link in links:
        sync = exchange_time(hops, sent, link) if workers > 1 else 0.0
        fragment = exchange_time(frag_hops, frag_sent, link) if workers > 1 else 0.0
        exposed = fragments * max(0.0, fragment - overlap_steps * step_time)  # per H steps
        row = {"link": link.describe(), "exchange_s": sync, "fragment_s": fragment,
               "ddp_util": step_time / (step_time + sync),
               "diloco_util": sync_every * step_time / (sync_every * step_time + exposed),
               "auto_h": choose_sync_every(SyncCost(fragment, step_time, fragments, overlap_steps), overlap_steps + 1)}
        if total_steps:
            per_worker = total_steps / workers
            row["single_s"] = total_steps * step_time
            row["ddp_s"] = per_worker * (step_time + sync)
            row["diloco_s"] = per_worker * step_time + per_worker / sync_every * exposed
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


def print_memory(model: str, config: TrainConfig, strategy):
    """Memory of one worker training `model` with `config` and `strategy`; returns its memory.Shape."""
    spec, shape = trained_shape(replace(config, model=model))  # adapters: what trains, and the frozen base
    n = shape.parameters
    config = replace(config, seq_len=config.seq_len or min(spec.context_length, DEFAULT_MAX_SEQ_LEN))
    o = MemoryOptions.of(config, strategy)
    est = estimate(shape, o)
    trained = f", {config.fine_tune_type} adapters {shape.trainable / 1e6:,.2f}M" if shape.trainable is not None else ""
    print(f"memory of one DiLoCo worker: model {model} ({n / 1e6:,.1f}M parameters{trained}), {o.describe()}")
    print("  " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in est.items() if v and k != "total"))
    print("  " + moments_choice(shape, o, est))
    macs = macs_it_fits(est["total"])
    print(f"  total {est['total'] / GB:.2f} GB ({est['total'] / n:.1f} bytes/parameter): fits Macs of "
          f"{', '.join(map(str, macs)) + ' GB' if macs else 'none up to 64 GB'} (the GPU may use ~{GPU_SHARE:.0%} of a "
          "Mac's memory by default)")
    for gb in MAC_MEMORY_GB:
        if gb not in macs and (smaller := make_it_fit(shape, o, gb * GB * GPU_SHARE)):
            print(f"  to fit a {gb} GB Mac: {flags(o, smaller)} --memory-limit {gb * GPU_SHARE:.1f} "
                  f"({estimate(shape, smaller)['total'] / GB:.2f} GB)")
            break
    print("  " + on_this_machine(shape, o, est["total"], hostinfo.training_memory()))
    print()
    return shape


def moments_choice(shape, o: MemoryOptions, est: dict) -> str:
    """What the AdamW moments' precision costs, as chosen and the other way: fp32 (the default, for
    quality) or bf16 (--moments-precision bf16; with bf16 weights, as plain MLX keeps them)."""
    labels = {"fp32": "fp32 (the default)", "bf16": "bf16 (--moments-precision bf16" + (
        ", as plain MLX keeps a bf16 model's)" if o.precision == "bf16" else ")")}
    other = "bf16" if o.moments_precision == "fp32" else "fp32"
    alt = estimate(shape, replace(o, moments_precision=other))
    return (f"AdamW moments: {labels[o.moments_precision]} {est['moments'] / GB:.2f} GB; "
            f"{labels[other]} {alt['moments'] / GB:.2f} GB, total {alt['total'] / GB:.2f} GB")


def print_plan(given: dict, model: str = None, params: float = None, links: list = None, total_steps: int = None):
    """`plan`'s output for the config keys and DiLoCo options `given` (over WHAT_IF and their
    defaults), `model` (also its memory) or `params`, `links` (Links or their text; default: every preset)."""
    config = TrainConfig.from_dict({**WHAT_IF, **given, "strategy": STRATEGY})
    strategy = make_strategy(config.strategy, config.strategy_options)
    shape = print_memory(model, config, strategy) if model else None
    adapters = shape is not None and shape.trainable is not None and not params
    if not params:  # what a sync exchanges: what trains (with adapters, the adapters alone)
        params = (shape.trainable if adapters else shape.parameters) if shape else 7e9
    links = [l if isinstance(l, Link) else parse_link(l) for l in links] if links else list(LINKS.values())
    options, workers, step_time, H = strategy.options(), config.workers, config.step_time, strategy.sync_every
    P, tau = strategy.sync_pieces, strategy.schedule.delay
    rows = plan(params, options["compress"], workers, H, step_time, links, total_steps, P, tau)
    codec = get_codec(options["compress"])
    algorithm, _, payload, sent = exchange_plan(codec, int(params), workers)
    _, _, _, frag_sent = exchange_plan(codec, int(params) // P, workers)
    if adapters:
        full_payload = exchange_plan(codec, shape.parameters, workers)[2]
        what = (f"{config.fine_tune_type} adapters {params / 1e6:,.2f}M of {shape.parameters / 1e9:.3g}B parameters"
                f" in {codec.name}: {human_bytes(payload)} per sync, {payload / full_payload:.2%} of the full model's "
                f"{human_bytes(full_payload)}")
    else:
        what = f"model {params / 1e9:g}B parameters in {codec.name} = {human_bytes(payload)} per sync"
    print(f"{what} ({payload / params:.3g} bytes/parameter); {workers} workers, {algorithm.replace('_', ' ')}: "
          f"each sends {human_bytes(sent)} per sync; step time {format_duration(step_time)}, H = {H}")
    if P > 1 or tau:
        print(f"streaming: {P} fragments, each exchange sends {human_bytes(frag_sent)} (peak), "
              f"overlapped with {tau} inner steps")
    head = f"{'link':34} {'sync time':>11} {'fragment':>11} {'DDP util':>9} {'DiLoCo util':>12} {'auto H':>7}"
    if total_steps:
        head += f" {'outer steps':>11} {'single':>11} {'DDP':>11} {'DiLoCo':>11}"
    print(head)
    for r in rows:
        line = (f"{r['link']:34} {format_duration(r['exchange_s']):>11} {format_duration(r['fragment_s']):>11} "
                f"{r['ddp_util']:>9.1%} {r['diloco_util']:>12.1%} {r['auto_h']:>7}")
        if total_steps:
            line += f" {total_steps / workers / r['auto_h']:>11.0f}"
        if total_steps:
            line += "".join(f" {format_duration(r[k]):>11}" for k in ("single_s", "ddp_s", "diloco_s"))
        print(line)
    print(legend(H, tau, workers, total_steps))


def legend(H: int, tau: int, workers: int, total_steps: int = None) -> str:
    """What the columns mean."""
    lines = ["sync time: one exchange of what trains (the whole model, or its adapters); fragment: one exchange "
             "of 1/P of it (Streaming DiLoCo, --fragments P; all of it when P = 1)",
             "DDP util, DiLoCo util: the share of the time spent computing, with an exchange after every step "
             f"(DDP) or every H = {H} steps (DiLoCo"
             + (f"; each fragment's exchange less what {tau} overlapped steps hide)" if tau else ")"),
             f"auto H: what --sync-every auto takes on that link, the smallest H whose exchanges stay within "
             f"{EXPOSED_BUDGET:.0%} of the wall-clock (fewer steps between syncs: closer to data-parallel)"]
    if total_steps:
        lines.append(f"outer steps: at auto H, the outer steps of the {total_steps:,} steps split over {workers} workers "
                     "(strategies/outer_lr.py: few outer steps cost quality); single, DDP, DiLoCo: time to train "
                     f"{total_steps:,} steps in all: on one machine, and split over {workers} workers with DDP or DiLoCo")
    return "\n".join(lines)
