"""Throughput on this device: the project's inner step against plain MLX and PyTorch, what simulating
N workers costs, and (on a CPU) N workers in K processes.

    python bench/throughput.py [--model small] [--batch-size 16] [--seq-len 64] [--precisions fp32 bf16]
                               [--tables step lora processes] [--steps 10]

MLX runs on its default device (a Mac's GPU, CUDA where mlx-cuda is installed, else the CPU);
PyTorch, where installed, on the same kind of device. Every setup steps in its own process
(bench/step_server.py), round-robin, one step of each per round: each sees the same machine
conditions (this CPU's speed drifts by tens of %), and each peak memory is its own. Tables, each
measured in one run, best step and median step of --steps rounds, and peak memory:

step (one per precision): tokens/s of
  - the project, one worker of batch B (training/workers.py, as `sim` and a cluster worker step it);
  - plain MLX: the step an MLX user writes (bench/mlx_baseline.py);
  - PyTorch's eager step (bench/torch_baseline.py --device);
  - the project, --vmapped N workers of B/N each, vectorized in one process: beside one worker with
    the N-times batch (the first row), what simulating N workers costs; and on a CPU of several
    cores, the same N workers in the processes `sim` runs them in by default (one per core, joined
    by MLX's ring: training/processes.py);
  - bf16: the project with --moments-precision bf16, AdamW's moments as plain MLX keeps them (the
    project's default keeps them in fp32: 4 bytes a parameter more); and with --offload-outer too,
    the step alone (DiLoCo's global model, fp32 between syncs, in a file: plain MLX holds none).
  Targets (issue 35): project / plain MLX >= 0.95; N vmapped / one worker >= 0.95; peak memory at
  most 10% above plain MLX's.
parts: the step by phase (a profile on any device): the whole step, the forward and backward passes
  alone, the update alone, for one worker of batch B and --vmapped N workers of B/N; what the vmapped
  step's extra time is spent on.
lora: the project's LoRA step (mlx-lm's adapters, masked loss, as `sim --fine-tune-type lora`
  trains) against mlx-lm's own trainer step (bench/mlx_baseline.py --lora), on an mlx-lm model
  folder made from --lora-model (random weights; kept in runs/bench/models), same batch and rank.
  Target: >= 0.95.
causes: the project's one-worker step with each part that issues 35 and 47 changed put back as it was
  (unfused attention, norms and loss; the update a group at a time; MLX's random bits for bf16's
  rounding; on a CPU, the update on one thread), and the step at the commit before issue 35 (.base/,
  where bench/gpu_speed.sh puts it).
pytorch (issue 22): PyTorch's one worker of batch B against the project's --vs-pytorch N workers of
  batch B each, in the processes `sim` runs them in by default.
sim (issue 47): the default `sim`'s step where it runs, 4 workers in sim's processes (2 on a
  2-core CPU) stepping at once, as is, with the loss's backward by ops, and before issue 35 (.base/).
processes (issue 12; a CPU's): one worker with an N-times batch; the simulator's N workers in K
  processes (`sim --processes K`, joined by MLX's ring over loopback, cores/K BLAS threads each); K = 2
  with every process using all the cores (no pinning: the wrong setting).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / ".base"  # the package at the commit before issue 35, for the causes table's "before" row
sys.path.insert(0, str(BASE if sys.argv[-1:] == ["before"] else ROOT))

from mlx_diloco.blas import ensure_fast_blas  # noqa: E402

if __name__ == "__main__":
    ensure_fast_blas(sys.argv)

BENCH = Path(__file__).parent
MODELS = ROOT / "runs" / "bench" / "models"


def project_step(model_name: str, precision: str, workers: int, batch_size: int, seq_len: int,
                 lora_rank: int = 0, comm=None, variant: str = "as is"):
    """One inner step of the project's workers (all `workers`, or comm's share), as a Run steps them,
    on a fixed batch of random tokens (their values do not change the cost). `lora_rank`: LoRA on
    every block of a model folder, with the masked loss of mlx-lm's data. `variant`: the step as it
    is, or with one of its parts as it was before issue 35 (VARIANTS: the causes table)."""
    import mlx.core as mx
    import numpy as np
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.exchange.comm import SimCommunicator
    from mlx_diloco.models.zoo import build_model, load_spec
    from mlx_diloco.strategies import make_strategy
    from mlx_diloco.training.run import convert_model
    from mlx_diloco.training.workers import Workers

    comm = comm or SimCommunicator(workers)
    options = dict(model=model_name, workers=workers, batch_size=batch_size, seq_len=seq_len, precision=precision,
                   sync_every=10_000)
    if lora_rank:
        options.update(fine_tune_type="lora", lora_rank=lora_rank, num_layers=-1)
    if variant.startswith("bf16 moments"):
        options.update(moments_precision="bf16")
    if variant == "bf16 moments, outer state on disk":  # the step alone: DiLoCo's fp32 global model elsewhere
        options.update(offload_outer=True)
    config = TrainConfig.from_dict(options)
    spec = load_spec(model_name)
    model = build_model(spec)
    convert_model(model, config)
    strategy = make_strategy(config.strategy, config.strategy_options)
    if hasattr(strategy, "for_job"):  # (the package before issue 45 resolved auto options in bind)
        strategy = strategy.for_job(config.workers, config.steps)
    strategy = strategy.bind(comm, config.steps)
    strategy.setup(model.trainable_parameters())
    w = Workers(model, comm.n_local, config, strategy.inner_optimizer(config), masked=bool(lora_rank),
                vectorize="auto", log=lambda m: None)
    if variant == "update in groups":
        w.whole_step = False
    tokens = mx.array(np.random.default_rng(0).integers(0, spec.vocab_size, (comm.n_local, batch_size, seq_len + 1)))
    x, y = tokens[..., :-1], tokens[..., 1:]
    steps = iter(range(1, 1 << 30))

    def step():
        return w.step(x, y, strategy, next(steps))
    if variant in PARTS:
        step = step_part(w, x, y, variant)
    step.lazy = lambda: w._whole_step(w.params, w.optimizer.state, x, y)  # the step's graph (bench/step_kernels.py)
    return step


# The parts of a step the parts table times on their own (a profile of the step by phase, on any device)
PARTS = ("gradients only", "update only")


def step_part(w, x, y, part: str):
    """One part of the workers' step, compiled as the step compiles it: the forward and backward
    passes (the gradients evaluated), or the clipped AdamW update of gradients computed once."""
    import mlx.core as mx
    if part == "gradients only":
        def gradients():
            mx.eval(w._compiled_grads(w.params, x, y))
            w.release()
        return gradients
    _, grads = w._compiled_grads(w.params, x, y)
    mx.eval(grads)
    w.release()
    params, state, scale = w.params, w.optimizer.state, mx.ones(w.n_local)

    def update():  # from the same parameters and moments each time (a trace leaves the optimizer its arrays)
        mx.eval(w._update(params, grads, state, scale))
    return update


# The parts of the step that issues 35 and 47 changed, each as it was (the causes table); "before": the whole
# step at the commit before (78320fe), checked out in .base/ (see bench/gpu_speed.sh).
VARIANTS = ("as is", "unfused kernels", "update in groups", "randint rounding", "update on one stream", "loss by ops",
            "before")


def variant_context(variant: str):
    """Put one part of the step back as it was (VARIANTS), in this process: a context to step in."""
    import contextlib
    import mlx.core as mx
    if variant == "unfused kernels":
        from mlx_diloco.models import kernels
        return kernels.chosen(fused=False)
    if variant == "update on one stream":  # the CPU's update on one thread, as before issue 47
        from mlx_diloco.training import workers as stepping
        stepping.cpu_threads = lambda: 1
    if variant == "randint rounding":  # MLX's random bits for every value, as before
        from mlx_diloco.models import precision as bf16
        bf16.dither16 = lambda bits, seed: mx.random.randint(0, 1 << 16, bits.shape, dtype=mx.uint32)
    if variant == "loss by ops":  # the CPU's cross-entropy differentiated op by op, its exponentials kept
        from mlx_diloco.models import fastmath

        def by_ops(logits, targets):
            logits = logits.astype(mx.float32)
            top = mx.stop_gradient(logits.max(axis=-1, keepdims=True))
            return mx.log(fastmath._exp(logits - top).sum(axis=-1)) + top[..., 0] - fastmath._picked(logits, targets)
        fastmath.token_cross_entropy = by_ops
    return contextlib.nullcontext()


def serve_project(model_name, precision, workers, batch_size, seq_len, lora_rank, variant="as is"):
    import mlx.core as mx
    from step_server import serve
    with variant_context(variant):
        serve(project_step(model_name, precision, workers, batch_size, seq_len, lora_rank, variant=variant),
              f"mlx-diloco, MLX {mx.__version__}", mx.get_peak_memory)


def ring_child(model_name, precision, workers, batch_size, seq_len, per_process, variant="as is"):
    """One process of a ProcessGroup: steps its replicas whenever the parent writes a line."""
    from mlx_diloco.exchange.ring import init_ring
    from step_server import serve
    import mlx.core as mx
    with variant_context(variant):
        serve(project_step(model_name, precision, workers, batch_size, seq_len, comm=init_ring(60.0, per_process),
                           variant=variant), "ring", mx.get_peak_memory)


def start(args, env=None) -> subprocess.Popen:
    """A Python script with arguments `args`, started with pipes to and from it."""
    return subprocess.Popen([sys.executable, *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)


class StepProcess:
    """A process that speaks bench/step_server.py's protocol (a script's arguments, or a process
    already started): calling it runs one step there. Started at once, waited for by `ready()`."""

    def __init__(self, args, env=None):
        self.proc = args if isinstance(args, subprocess.Popen) else start(args, env)
        self.label = None

    def ready(self):
        if self.label is None:
            line = self.proc.stdout.readline().strip()
            if not line.startswith("ready"):
                self.close()
                raise RuntimeError(f"{' '.join(map(str, self.proc.args[1:4]))} failed to start "
                                   f"(exit {self.proc.returncode})")
            self.label = line.removeprefix("ready ")
        return self

    def send(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def __call__(self):
        self.send("step")

    def peak(self):
        answer = self.send("peak")
        return int(answer) if answer.isdigit() else None

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


class ProcessGroup:
    """`sim --processes K` without the run around it: K processes joined by MLX's ring, each
    stepping workers/K vmapped replicas; calling it runs one step in all of them."""

    def __init__(self, model_name, workers, batch_size, seq_len, K, blas_threads, precision="fp32", variant="as is"):
        from mlx_diloco.training.processes import free_ports
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-throughput-")
        hostfile = Path(self.tmp.name) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(K)]))
        args = [__file__, "--ring-child", model_name, precision, workers, batch_size, seq_len, workers // K, variant]
        # all started before any is waited for: each waits in the ring's set-up for the others
        procs = [start(args, {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile),
                              "OPENBLAS_NUM_THREADS": str(blas_threads)}) for r in range(K)]
        self.procs = [StepProcess(p) for p in procs]

    def ready(self):
        for p in self.procs:
            p.ready()
        return self

    def __call__(self):
        for p in self.procs:
            p.proc.stdin.write("step\n")
            p.proc.stdin.flush()
        for p in self.procs:
            p.proc.stdout.readline()

    def peak(self):
        return max(p.peak() or 0 for p in self.procs)

    def close(self):
        for p in self.procs:
            p.close()
        self.tmp.cleanup()


def step_times(setups: dict, rounds: int) -> dict:
    """Round-robin over the setups, one step each per round, after 3 of warm-up: each setup's step
    times, in seconds."""
    for _ in range(3):
        for run in setups.values():
            run()
    times = {name: [] for name in setups}
    for _ in range(rounds):
        for name, run in setups.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return times


def measured(setups: dict, rounds: int) -> dict:
    """{name: (best s, median s, peak bytes or None)}, the setups closed after. A setup that fails
    to start is left out, with a line saying so."""
    try:
        for name in list(setups):
            try:
                setups[name].ready()
            except RuntimeError as e:
                print(f"left out {name}: {e}", flush=True)
                del setups[name]
        times = step_times(setups, rounds)
        return {k: (min(t), statistics.median(t), setups[k].peak()) for k, t in times.items()}
    finally:
        for s in setups.values():
            s.close()


def torch_device():
    """The device PyTorch would train on here, of the kind MLX runs on; None without torch."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return None
    import mlx.core as mx
    import torch
    if mx.default_device() == mx.gpu:
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else None
    return "cpu"


def torch_env() -> dict:
    """PyTorch as its users run it: without the OpenBLAS preload and thread settings this bench runs MLX with."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["LD_PRELOAD"] = ":".join(lib for lib in env.get("LD_PRELOAD", "").split(":") if "openblas" not in lib)
    return env


def print_rows(title: str, results: dict, labels: dict, tokens: dict, ratios: dict):
    """One table: tokens/s best and median, peak memory, and each row's ratios to another row's."""
    print(f"\n{title}\n")
    print(f"{'setup':60} {'tokens/s best':>14} {'median':>10} {'peak MB':>9}   ratios (best, median)")
    for key, (best, median, peak) in results.items():
        parts = []
        for name, other in ratios.get(key, []):
            if other in results and other != key:
                b, m = (tokens[key] / results[key][i] / (tokens[other] / results[other][i]) for i in (0, 1))
                mem = f", memory {peak / results[other][2]:.2f}x" if peak and results[other][2] else ""
                parts.append(f"{name} {b:.2f} / {m:.2f}{mem}")
        peak_text = f"{peak / 1e6:9,.0f}" if peak else f"{'-':>9}"
        print(f"{labels[key]:60} {tokens[key] / best:14,.0f} {tokens[key] / median:10,.0f} {peak_text}   "
              f"{'; '.join(parts)}")


def step_table(args, precision: str):
    B, T, N = args.batch_size, args.seq_len, args.vmapped
    common = ["--batch-size", B, "--seq-len", T, "--precision", precision]
    setups = {"project": StepProcess([__file__, "--project", args.model, precision, 1, B, T, 0]),
              "plain": StepProcess([BENCH / "mlx_baseline.py", "--serve", "--model", args.model, *common])}
    labels = {"project": f"project, 1 worker x {B}", "plain": f"plain MLX step, {B}"}
    device = torch_device()
    if device and json.loads((ROOT / "models" / f"{args.model}.json").read_text())["type"] == "gpt":
        setups["torch"] = StepProcess([BENCH / "torch_baseline.py", "--serve", "--model", args.model, "--device",
                                       device, *common], env=torch_env())
    if N > 1 and B % N == 0:
        setups["vmapped"] = StepProcess([__file__, "--project", args.model, precision, N, B // N, T, 0])
        labels["vmapped"] = f"project, {N} vmapped workers x {B // N}"
        from mlx_diloco.training.processes import choose_processes, usable_cores
        K = choose_processes(N)
        if K > 1:  # the processes `sim` runs N workers in by default here (one per core on a CPU)
            setups["processes"] = ProcessGroup(args.model, N, B // N, T, K, max(1, usable_cores() // K), precision)
            labels["processes"] = f"project, {N} workers x {B // N} in {K} processes (sim's default)"
    if precision == "bf16":  # the moments as plain MLX keeps them: the same memory
        for variant, flags in [("bf16 moments", ""), ("bf16 moments, outer state on disk", " --offload-outer")]:
            setups[variant] = StepProcess([__file__, "--project", args.model, precision, 1, B, T, 0, variant])
            labels[variant] = f"project, 1 worker x {B}, --moments-precision bf16{flags}"
    results = measured(setups, args.steps)
    if "torch" in results:
        labels["torch"] = f"{setups['torch'].label}, {B}" + (" (autocast)" if precision == "bf16" else "")
    print_rows(f"model {args.model} {precision}, {B}x{T} tokens a step; {args.steps} interleaved steps each "
               f"(MLX on {device_name()})", results, labels, {k: B * T for k in results},
               {"project": [("vs plain MLX", "plain")], "torch": [("vs plain MLX", "plain")],
                "vmapped": [("vs 1 worker x N*B", "project")], "processes": [("vs 1 worker x N*B", "project")],
                "bf16 moments": [("vs plain MLX", "plain")],
                "bf16 moments, outer state on disk": [("vs plain MLX", "plain")]})


def causes_table(args, precision: str):
    """The project's one-worker step as it is, with each part issue 35 changed as it was before, and
    the whole step at the commit before (where .base/ holds it): where the time went."""
    B, T = args.batch_size, args.seq_len
    variants = [v for v in VARIANTS if v != "before" or (BASE / "mlx_diloco").is_dir()]
    setups = {v: StepProcess([__file__, "--project", args.model, precision, 1, B, T, 0, v]) for v in variants}
    results = measured(setups, args.steps)
    print_rows(f"causes: model {args.model} {precision}, {B}x{T} tokens a step, one worker; {args.steps} interleaved "
               f"steps each (MLX on {device_name()})", results,
               {v: f"project, {v}" for v in results}, {v: B * T for v in results},
               {v: [("vs as is", "as is")] for v in results})


def sim_table(args, cores: int):
    """The default `sim`'s step as it runs there: its workers in the processes sim starts (joined by
    MLX's ring, cores/K BLAS threads each), all stepping at once; as is, with the cross-entropy's
    backward by ops, and at the commit before issue 35 (.base/, where it is there)."""
    from mlx_diloco.training.processes import choose_processes
    B, T, N = args.batch_size, args.seq_len, 4
    K = choose_processes(N)
    variants = [v for v in ("as is", "loss by ops", "before") if v != "before" or (BASE / "mlx_diloco").is_dir()]
    setups = {v: ProcessGroup(args.model, N, B, T, K, max(1, cores // K), variant=v) for v in variants}
    results = measured(setups, args.steps)
    print_rows(f"sim: model {args.model} fp32, {N} workers x {B}x{T} tokens in {K} processes of {max(1, cores // K)} "
               f"BLAS threads, all stepping at once; {args.steps} interleaved steps each (MLX on {device_name()})",
               results, {v: f"default sim's step, {v}" for v in results}, {v: N * B * T for v in results},
               {v: [("vs as is", "as is")] for v in results})


def parts_table(args, precision: str):
    """The step by phase, for one worker of batch B and N vmapped workers of B/N: the whole step,
    its forward and backward passes alone, its update alone (what the vmapped step's extra time is)."""
    B, T, N = args.batch_size, args.seq_len, args.vmapped
    setups, labels = {}, {}
    for n in (1, N) if N > 1 and B % N == 0 else (1,):
        for part in ("as is", *PARTS):
            setups[(n, part)] = StepProcess([__file__, "--project", args.model, precision, n, B // n, T, 0, part])
            labels[(n, part)] = f"{n} worker{'s' if n > 1 else ''} x {B // n}, " + (
                "whole step" if part == "as is" else part)
    results = measured(setups, args.steps)
    labels = {k: f"{labels[k]} ({best * 1e3:.1f} ms)" for k, (best, _, _) in results.items()}
    print_rows(f"parts: model {args.model} {precision}, {B}x{T} tokens a step; {args.steps} interleaved steps each "
               f"(MLX on {device_name()})", results, labels, {k: B * T for k in results},
               {k: [("vs 1 worker", (1, k[1]))] for k in results if k[0] > 1})


def lora_table(args, precision: str):
    B, T, rank = args.batch_size, args.seq_len, args.lora_rank
    folder = mlx_lm_folder(args.lora_model)
    setups = {"project": StepProcess([__file__, "--project", folder, precision, 1, B, T, rank]),
              "mlx-lm": StepProcess([BENCH / "mlx_baseline.py", "--serve", "--lora", folder, "--lora-rank", rank,
                                     "--batch-size", B, "--seq-len", T, "--precision", precision])}
    labels = {"project": f"project LoRA, rank {rank}, {B}", "mlx-lm": f"mlx-lm trainer step, rank {rank}, {B}"}
    results = measured(setups, args.steps)
    print_rows(f"LoRA on {args.lora_model} {precision} (mlx-lm folder), {B}x{T} tokens a step; {args.steps} "
               f"interleaved steps each (MLX on {device_name()})", results, labels, {k: B * T for k in results},
               {"project": [("vs mlx-lm", "mlx-lm")]})


def mlx_lm_folder(preset: str) -> str:
    """An mlx-lm model folder of the preset's architecture with random weights (fp32), made once."""
    folder = MODELS / preset
    if not (folder / "config.json").exists():
        import mlx.core as mx
        from mlx_lm.utils import save_config, save_model
        from mlx_diloco.models.zoo import build_model, load_spec
        spec = load_spec(preset)
        model = build_model(spec)
        mx.eval(model.parameters())
        folder.mkdir(parents=True, exist_ok=True)
        save_model(folder, model)
        save_config({"model_type": spec.type, **{k: v for k, v in spec.params.items() if k != "type"}},
                    folder / "config.json")
    return str(folder)


def device_name() -> str:
    import mlx.core as mx
    info = mx.device_info()
    return f"{mx.default_device()}, {info.get('device_name', info.get('architecture', '?'))}"


def pytorch_table(args, cores: int):
    """PyTorch's step of one worker of batch B against the project's N workers of batch B, in the
    processes `sim` picks by default (issue 22's comparison)."""
    from mlx_diloco.training.processes import choose_processes
    B, T = args.batch_size, args.seq_len
    setups = {"torch": StepProcess([BENCH / "torch_baseline.py", "--serve", "--model", args.model, "--device",
                                    torch_device(), "--batch-size", B, "--seq-len", T], env=torch_env())}
    labels = {}
    for n in args.vs_pytorch:
        K = choose_processes(n)
        setups[n] = (StepProcess([__file__, "--project", args.model, "fp32", n, B, T, 0]) if K == 1 else
                     ProcessGroup(args.model, n, B, T, K, max(1, cores // K)))
        labels[n] = f"sim {n} worker{'s' if n > 1 else ''}, {K} process{'es' if K > 1 else ''}"
    results = measured(setups, args.steps)
    labels["torch"] = f"{setups['torch'].label}, 1 worker"
    print_rows(f"model {args.model} fp32, B={B}, T={T}, {cores} cores; {args.steps} interleaved steps each", results,
               labels, {k: (1 if k == "torch" else k) * B * T for k in results},
               {k: [("vs PyTorch", "torch")] for k in results})


def processes_table(args, cores: int):
    B, T = args.batch_size, args.seq_len
    setups, labels = {}, {}
    for n in args.workers:
        setups[(n, "batch")] = StepProcess([__file__, "--project", args.model, "fp32", 1, n * B, T, 0])
        labels[(n, "batch")] = f"1 worker, batch {n}*B, 1 process"
        for K in args.processes:
            if n % K:
                continue
            setups[(n, K)] = (StepProcess([__file__, "--project", args.model, "fp32", n, B, T, 0]) if K == 1 else
                              ProcessGroup(args.model, n, B, T, K, max(1, cores // K)))
            labels[(n, K)] = f"sim {n} workers, {K} process{'es' if K > 1 else ''}"
        if 2 in args.processes and n % 2 == 0 and cores > 1:
            setups[(n, "unpinned")] = ProcessGroup(args.model, n, B, T, 2, cores)
            labels[(n, "unpinned")] = f"sim {n} workers, 2 processes, {cores} BLAS threads each"
    results = measured(setups, args.steps)
    print_rows(f"model {args.model} fp32, B={B}, T={T}, {cores} cores; {args.steps} interleaved steps each",
               results, labels, {k: k[0] * B * T for k in results},
               {k: [("vs 1 process", (k[0], 1)), ("vs 1 worker N*B", (k[0], "batch"))]
                for k in results if k[1] != "batch"})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset")
    p.add_argument("--batch-size", type=int, default=16, help="B: sequences per step of one worker")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (after 3 of warm-up)")
    p.add_argument("--vmapped", type=int, default=4, help="N: the step table's vectorized workers (of B/N each)")
    p.add_argument("--lora-model", default="llama-150m", help="the lora table's preset (an mlx-lm architecture)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="the processes table's worker counts N")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="the processes table's process counts K")
    p.add_argument("--vs-pytorch", type=int, nargs="+", default=[1, 4, 8],
                   help="the pytorch table's worker counts N, in sim's default processes")
    p.add_argument("--tables", nargs="+", choices=["step", "causes", "lora", "parts", "pytorch", "processes", "sim"], default=["step"])
    p.add_argument("--project", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--ring-child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.project:  # model precision workers batch seq-len lora-rank [variant]
        model, precision, *numbers = args.project[:6]
        return serve_project(model, precision, *map(int, numbers), *args.project[6:])
    if args.ring_child:
        model, precision, *numbers, variant = args.ring_child
        return ring_child(model, precision, *map(int, numbers), variant)
    from cluster_links import doctor_gflops
    print(f"# python bench/throughput.py {' '.join(sys.argv[1:])}   (doctor: {doctor_gflops()})", flush=True)
    for precision in args.precisions:
        if "step" in args.tables:
            step_table(args, precision)
        if "causes" in args.tables:
            causes_table(args, precision)
        if "lora" in args.tables:
            lora_table(args, precision)
        if "parts" in args.tables:
            parts_table(args, precision)
    from mlx_diloco.training.processes import usable_cores
    if "pytorch" in args.tables and torch_device():
        pytorch_table(args, usable_cores())
    if "processes" in args.tables:
        processes_table(args, usable_cores())
    if "sim" in args.tables:
        sim_table(args, usable_cores())


if __name__ == "__main__":
    main()
