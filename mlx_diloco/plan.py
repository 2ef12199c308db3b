"""`mlx-diloco plan`: what-if estimates of sync time and utilisation for any model, link and H,
codec, number of fragments (Streaming DiLoCo) and overlap; with --model, memory per worker too."""

from .exchange.codecs import get_codec
from .exchange.comm import exchange_plan
from .cluster import hostinfo
from .exchange.network import LINKS, exchange_time, parse_link
from .memory import GB, GPU_SHARE, MAC_MEMORY_GB, MemoryOptions, estimate, flags, macs_it_fits, make_it_fit, model_shape
from .training.metrics import human_bytes


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
        row = {"link": link.describe(), "sync_s": sync, "fragment_s": fragment,
               "ddp_util": step_time / (step_time + sync),
               "diloco_util": sync_every * step_time / (sync_every * step_time + exposed)}
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


def model_params(name: str):
    """(preset spec, parameter count), without allocating the weights."""
    from .models.zoo import build_model, count_parameters, load_spec
    spec = load_spec(name)
    return spec, count_parameters(build_model(spec, lazy=True))


def worker_estimate(config) -> tuple:
    """(MemoryOptions, Shape, estimate) of one worker of a resolved TrainConfig (one per machine)."""
    spec, n = model_params(config.model)
    o, shape = MemoryOptions.of(config), model_shape(spec.params, n)
    return o, shape, estimate(shape, o)


def print_memory(args):
    spec, n = model_params(args.model)
    o = MemoryOptions(args.batch_size, args.seq_len or min(spec.context_length, 1024), args.precision,
                      args.moments_precision, args.grad_checkpoint, args.offload_outer, args.fragments)
    shape = model_shape(spec.params, n)
    est = estimate(shape, o)
    print(f"memory of one DiLoCo worker: model {args.model} ({n / 1e6:,.1f}M parameters), {o.describe()}")
    print("  " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in est.items() if v and k != "total"))
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
    return n


def on_this_machine(shape, o: MemoryOptions, total: float, budget: float) -> str:
    """Whether the job fits the `budget` bytes this machine offers, and the --memory-limit to
    train it with: never more than the machine has. MLX allocates each operation's output when it
    queues it, ahead of running it: unchecked, a step's peak can exceed what it needs by half
    (docs/memory.md)."""
    def limit(total):
        return f"--memory-limit {min(total * 1.05, budget) / GB:.3g}"  # GB; 0 would mean no limit
    here = f"on this machine ({budget / GB:.1f} GB for training)"
    if total <= budget:
        return f"{here}: keep the peak near the estimate with {limit(total)} (agents set it to what they offer)"
    smaller = make_it_fit(shape, o, budget)
    if smaller is None:
        return f"{here}: does not fit, even at batch size 1 with every option above; use a smaller model"
    smaller_total = estimate(shape, smaller)["total"]
    return f"{here}: does not fit as is; with {flags(o, smaller)} {limit(smaller_total)} ({smaller_total / GB:.2f} GB)"


def print_plan(args):
    if args.model:
        n = print_memory(args)
        args.params = args.params or n
    args.params = args.params or 7e9
    links = [parse_link(l) for l in args.link] if args.link else list(LINKS.values())
    P, tau = args.fragments, args.overlap_steps
    rows = plan(args.params, args.compress, args.workers, args.sync_every, args.step_time, links,
                args.total_steps, P, tau)
    codec = get_codec(args.compress)
    algorithm, _, payload, sent = exchange_plan(codec, int(args.params), args.workers)
    _, _, _, frag_sent = exchange_plan(codec, int(args.params) // P, args.workers)
    print(f"model {args.params / 1e9:g}B parameters in {codec.name} = {human_bytes(payload)} per sync "
          f"({payload / args.params:.3g} bytes/parameter); {args.workers} workers, {algorithm.replace('_', ' ')}: "
          f"each sends {human_bytes(sent)} per sync; step time {format_duration(args.step_time)}, H = {args.sync_every}")
    if P > 1 or tau:
        print(f"streaming: {P} fragments, each exchange sends {human_bytes(frag_sent)} (peak), "
              f"overlapped with {tau} inner steps")
    head = f"{'link':34} {'sync time':>11} {'fragment':>11} {'DDP util':>9} {'DiLoCo util':>12}"
    if args.total_steps:
        head += f" {'single':>11} {'DDP':>11} {'DiLoCo':>11}"
    print(head)
    for r in rows:
        line = (f"{r['link']:34} {format_duration(r['sync_s']):>11} {format_duration(r['fragment_s']):>11} "
                f"{r['ddp_util']:>9.1%} {r['diloco_util']:>12.1%}")
        if args.total_steps:
            line += "".join(f" {format_duration(r[k]):>11}" for k in ("single_s", "ddp_s", "diloco_s"))
        print(line)
    print(legend(args))


def legend(args) -> str:
    """What the columns mean."""
    lines = ["sync time: one exchange of the whole model; fragment: one exchange of 1/P of it (Streaming "
             "DiLoCo, --fragments P; the whole model when P = 1)",
             "DDP util, DiLoCo util: the share of the time spent computing, with an exchange after every step "
             f"(DDP) or every H = {args.sync_every} steps (DiLoCo"
             + (f"; each fragment's exchange less what {args.overlap_steps} overlapped steps hide)"
                if args.overlap_steps else ")")]
    if args.total_steps:
        lines.append(f"single, DDP, DiLoCo: time to train {args.total_steps:,} steps in all: on one machine, "
                     f"and split over {args.workers} workers with DDP or DiLoCo")
    return "\n".join(lines)
