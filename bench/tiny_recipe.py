"""What bench/outer_grid.py and bench/scaling_table.py share: the scaling-law paper's recipe at
`tiny` (arXiv 2503.09799, section 3), a store of finished runs, and the walk that finds a
hyperparameter's best value on a grid.

The recipe: `tiny` (42,144 parameters) on Shakespeare, sequences of 32 tokens, warmup T/10, then
cosine to 5% of the peak lr, weight decay 1/T, AdamW betas 0.9/0.99, clipping 1.0; the global batch
split over the M replicas. Every run evaluates the same first EVAL_SEQUENCES held-out sequences (64K
tokens) at its end.
"""

import json
import math
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

MODEL, SEQ = "tiny", 32
SEQ_OF = {MODEL: SEQ, "small": 64}    # each model's sequences: its context (another size checks the rule)
EVAL_SEQUENCES = 2048                 # 64K held-out tokens, the same for every run
TOKENS_PER_PARAMETER = 20
PARAMETERS = 42_144                   # tiny's (count_parameters(build_model(load_spec("tiny"))))
ROOT2 = math.sqrt(2)


def steps_for(tokens_per_parameter: float, global_batch: int) -> int:
    """T: the steps of `global_batch` sequences that train on tokens_per_parameter x PARAMETERS tokens."""
    return int(tokens_per_parameter * PARAMETERS // (global_batch * SEQ))


def base_config(T: int, lr: float, seed: int = 0, model: str = MODEL) -> dict:
    return dict(model=model, seq_len=SEQ_OF[model], steps=T, warmup=T // 10, final_lr=0.05, beta1=0.9, beta2=0.99,
                weight_decay=1 / T, grad_clip=1.0, eval_every=T, eval_sequences=EVAL_SEQUENCES,
                data="shakespeare", lr=lr, seed=seed)


def dp_config(T: int, lr: float, global_batch: int = 16, seed: int = 0, model: str = MODEL) -> dict:
    """Data-parallel: AdamW on the whole batch (one worker: what DP computes, its gradient clipped as one)."""
    return {**base_config(T, lr, seed, model), "workers": 1, "strategy": "ddp", "batch_size": global_batch}


def diloco_config(M: int, H: int, T: int, lr: float, outer_lr, mu, global_batch: int = 16, seed: int = 0,
                  model: str = MODEL) -> dict:
    """DiLoCo with M replicas of global_batch / M sequences each (outer_lr and mu may be 'auto')."""
    return {**base_config(T, lr, seed, model), "workers": M, "strategy": "diloco", "batch_size": global_batch // M,
            "sync_every": H, "outer_lr": outer_lr if outer_lr == "auto" else round(outer_lr, 4),
            "outer_momentum": mu, "seed": seed}


def name(c: dict) -> str:
    """A run's folder name: what varies between runs of the recipe."""
    seed = f"_s{c['seed']}" if c["seed"] else ""
    batch = c["batch_size"] * c["workers"]
    batch = f"_B{batch}" if batch != 16 else ""
    model = f"{c['model']}_" if c["model"] != MODEL else ""
    if c["strategy"] == "ddp":
        return f"{model}dp_T{c['steps']}_lr{c['lr']:g}{batch}{seed}"
    return (f"{model}M{c['workers']}_H{c['sync_every']}_T{c['steps']}_mu{c['outer_momentum']:g}"
            f"_olr{c['outer_lr']:g}_lr{c['lr']:g}{batch}{seed}")


def train(config: dict, run_dir: str) -> float:
    """One run in a pool's process (resumed if it was cut off): its final eval loss (inf if it diverged)."""
    from mlx_diloco.config import TrainConfig
    from mlx_diloco.run_folder import latest_step
    from mlx_diloco.training.processes import simulate
    summary = Path(run_dir) / "summary.json"
    if not summary.exists():
        resume = latest_step(run_dir) is not None
        if not resume and Path(run_dir).exists():  # cut off before its first checkpoint: nothing to resume
            shutil.rmtree(run_dir)
        simulate(TrainConfig.from_dict(config), Path(run_dir), processes=1, resume=resume, log=lambda m: None)
    loss = json.loads(summary.read_text())["final_eval_loss"]
    return loss if loss is not None and math.isfinite(loss) else float("inf")


class Runs:
    """Every run's final eval loss by name, kept in FILE (runs.json) beside the run folders; runs
    one at a time, each in a spawned process (MLX per run, nothing shared)."""

    def __init__(self, out: Path, file: str = "runs.json"):
        self.out, self.file = Path(out), Path(out) / file
        self.out.mkdir(parents=True, exist_ok=True)
        self.losses = json.loads(self.file.read_text()) if self.file.exists() else {}
        self.configs = {}  # name -> config, of the runs asked for by this invocation
        self.pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"))

    def loss(self, config: dict) -> float:
        key = name(config)
        self.configs[key] = config
        if key not in self.losses:
            start = time.time()
            self.losses[key] = self.pool.submit(train, config, str(self.out / key)).result()
            self.file.write_text(json.dumps(self.losses, indent=1, sort_keys=True))
            print(f"  {key}: {self.losses[key]:.4f} ({time.time() - start:.0f} s)", flush=True)
        return self.losses[key]

    def best(self, keep) -> dict:
        """The config (with its "loss") of the lowest loss among the runs asked for whose config `keep` accepts."""
        key = min((k for k, c in self.configs.items() if keep(c)), key=self.losses.get)
        return {**self.configs[key], "loss": self.losses[key], "name": key}


def walk(f, start: int, lo: int, hi: int) -> int:
    """The index in [lo, hi] where f is lowest, walking from `start` to a neighbour while it improves
    (f at the start and a neighbour, then onward in the better direction; the other side if that
    first neighbour was worse)."""
    best = start
    for step in (-1, 1):
        i = best
        while lo <= i + step <= hi and f(i + step) < f(best):
            i += step
            best = i
        if best != start:
            break
    return best


def walk_values(f, values: list, start) -> dict:
    """{value: f(value)} of the values `walk` tried, from `start` (one of `values`)."""
    tried = {}
    walk(lambda i: tried.setdefault(values[i], f(values[i])), values.index(start), 0, len(values) - 1)
    return tried
