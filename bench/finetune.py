"""A real fine-tune, end to end with the command lines a user runs (issue 23).

    python bench/finetune.py [--out runs/finetune] [--quick] [--report-only]

1. Pretrain the llama-small preset (mlx-lm's Llama, 4 layers, d=128, 1.1M parameters) on the
   embedded Shakespeare with one worker (`mlx-diloco sim`), export it as an mlx-lm model folder
   (`mlx-diloco export`), and give its tokenizer a chat template, as anyone fine-tuning their own
   base model for chat does.
2. Chat data from the plays: two consecutive speeches of a scene are a user message and the
   assistant's reply, each with its speaker's header, as in the corpus ("BRUTUS.\\n<speech>");
   train.jsonl from the first 90% of the text, valid.jsonl from the last 10%.
3. LoRA on every block (--mask-prompt: the loss on the reply only), the same steps, batch per worker
   and seed for DiLoCo (4 workers, H=50), DDP (4 workers) and one worker (the same steps per worker:
   a quarter of the tokens). The bytes each sync sends are checked against the adapters' parameter
   count in the fp16 codec, and compared with what the whole model would send.
4. QLoRA: the base quantized to 4 bits by mlx-lm's converter (`python -m mlx_lm convert -q`),
   then the same DiLoCo LoRA run on it.
5. The report (--report-only: from the runs already in --out): a table, the first chat of
   valid.jsonl answered by `python -m mlx_lm generate` with and without the DiLoCo adapters, and
   the eval-loss curves (`mlx-diloco plot`).

Writes bench/results/finetune.txt and finetune.png. About 15 minutes on an idle 2-core CPU, most
of it the QLoRA run (MLX's quantized matmul is slow on a CPU); --quick: 2 minutes, to check the
pipeline.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIN = Path(sys.executable).parent
RESULTS = ROOT / "bench" / "results"
MODEL = "llama-small"
# The corpus's format, message by message: a speech and a blank line; the reply ends the turn with
# the tokenizer's end-of-text token, so that generation stops after it. trim_blocks (transformers
# renders templates with it) would eat a newline written after a tag: the blank line is an expression.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n\\n' }}{% endif %}"
                 "{% endfor %}")
SPEAKER = re.compile(r"^(?:[A-Z][\w'&-]*\.? ){0,3}[A-Z][\w'&-]*\.$")  # "BRUTUS.", "Ham.", "FIRST LORD."
STAGE = {"ACT", "SCENE", "Enter", "Exit", "Exeunt", "Re-enter", "Flourish", "Alarum"}
SEQ_LEN = 64  # tokens per example: short exchanges (QLoRA's quantized matmuls are slow on a CPU)
BATCH = 4  # chats per worker per step
# The adapters' peak learning rate, from the one-worker run of this bench at three: the default 1e-3 made
# the eval loss climb after step 50 (3.242 at step 50, 3.277 at 300); 3e-4 ended at 3.206; 1e-4 lowers it
# at every evaluation, to 3.202.
LR = 1e-4
VALID_FROM = 0.9  # the last 10% of the text is held out


def settings(quick: bool) -> dict:
    if quick:
        return dict(pretrain_steps=30, steps=20, sync_every=10, eval_sequences=2 * BATCH)
    return dict(pretrain_steps=500, steps=300, sync_every=50, eval_sequences=25 * BATCH)


def cli(log: Path, *args):
    """Run a command of .venv/bin (mlx-diloco, or python -m ...) with its output in `log`."""
    with open(log, "w") as f:
        done = subprocess.run([str(BIN / args[0]), *map(str, args[1:])], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(map(str, args))}\n{log.read_text()[-3000:]}")


def run_summary(run: Path) -> dict:
    """A run's summary.json, with its folder, its wall time (its last metrics row's) and its eval loss
    before training (its first row's)."""
    first, *_, last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {**json.loads((run / "summary.json").read_text()), "wall_s": last["wall_s"],
            "start_eval_loss": first["eval_loss"], "run": run}


# ------------------------------------------------------------------ 1. the base model

def pretrain(out: Path, s: dict) -> Path:
    """Pretrain llama-small on Shakespeare with one worker; export it with a chat template."""
    run, base = out / "pretrain", out / "base"
    cli(out / "pretrain.log", "mlx-diloco", "sim", "--model", MODEL, "--data", "shakespeare", "--workers", 1,
        "--strategy", "ddp", "--steps", s["pretrain_steps"], "--batch-size", 16, "--seq-len", 128, "--lr", 2e-3,
        "--eval-every", s["pretrain_steps"], "--sample-tokens", 0, "--run-dir", run)
    cli(out / "export.log", "mlx-diloco", "export", run, base)
    config_file = base / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": CHAT_TEMPLATE}))
    return base


# ------------------------------------------------------------------ 2. chat data from the plays

def speeches(text: str) -> list:
    """(position in the text, speech with its speaker's header) of each block of the text, None for
    the blocks that are no speech (stage directions, act and scene headings): they end a dialogue."""
    blocks, position = [], 0
    for block in re.split(r"(\n[ \t]*\n)", text):
        lines = block.strip("\n").split("\n")
        is_speech = len(lines) > 1 and SPEAKER.match(lines[0]) and lines[0].split()[0].rstrip(".") not in STAGE
        if block.strip():
            blocks.append((position, block.strip("\n") if is_speech else None))
        position += len(block)
    return blocks


def write_chats(folder: Path, base: Path):
    """train.jsonl and valid.jsonl: each pair of consecutive speeches by two speakers that fits
    SEQ_LEN + 1 tokens through the base's tokenizer and chat template, as a user message and the
    assistant's reply."""
    from mlx_lm.utils import load_tokenizer
    from mlx_diloco.data.datasets import load_text
    text, tokenizer = load_text("shakespeare"), load_tokenizer(base)
    blocks = speeches(text)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as train, open(folder / "valid.jsonl", "w") as valid:
        for (position, said), (_, reply) in zip(blocks, blocks[1:]):
            if not (said and reply) or said.split("\n")[0] == reply.split("\n")[0]:
                continue
            messages = [{"role": "user", "content": said}, {"role": "assistant", "content": reply}]
            if len(tokenizer.apply_chat_template(messages)) <= SEQ_LEN + 1:
                split = valid if position >= VALID_FROM * len(text) else train
                split.write(json.dumps({"messages": messages}) + "\n")


# ------------------------------------------------------------------ 3, 4. the fine-tunes

def fine_tunes(s: dict) -> dict:
    """{run: (its base model's folder, its flags)}: what sets each fine-tune apart."""
    H = s["sync_every"]
    return {"diloco": ("base", ["--strategy", "diloco", "--sync-every", H]),
            "ddp": ("base", ["--strategy", "ddp"]),
            "single": ("base", ["--strategy", "ddp", "--workers", 1]),
            "qlora-diloco": ("base-4bit", ["--strategy", "diloco", "--sync-every", H])}


def fine_tune(name: str, base: Path, out: Path, s: dict, *flags):
    """One LoRA run of `mlx-diloco sim` on the chats."""
    run = out / name
    cli(out / f"{name}.log", "mlx-diloco", "sim", "--model", base, "--data", out / "chats", "--mask-prompt",
        "--fine-tune-type", "lora", "--num-layers", 4, "--lora-rank", 8, "--seq-len", SEQ_LEN,
        "--batch-size", BATCH, "--lr", LR, "--steps", s["steps"], "--seed", 0, "--eval-every", s["sync_every"],
        "--eval-sequences", s["eval_sequences"], "--sample-tokens", 0, "--run-dir", run, *flags)
    r = run_summary(run)
    print(f"{name:14} eval loss {r['final_eval_loss']:.4f}  sent {r['bytes_sent_per_worker']:,} B per worker  "
          f"{r['wall_s']:.0f} s", flush=True)


def quantize(base: Path, out: Path):
    """The base in 4 bits by mlx-lm's converter (groups of 64: they divide d=128 and the MLP's 384)."""
    cli(out / "convert.log", "python", "-m", "mlx_lm", "convert", "--hf-path", base, "--mlx-path",
        out / "base-4bit", "-q", "--q-bits", 4, "--q-group-size", 64)


def train(out: Path, s: dict):
    """Everything the report reads, from scratch: the base, the data, the 4-bit base, the fine-tunes."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    base = pretrain(out, s)
    r = run_summary(out / "pretrain")
    print(f"pretrained {MODEL}: eval loss {r['final_eval_loss']:.4f}, {r['wall_s']:.0f} s", flush=True)
    write_chats(out / "chats", base)
    quantize(base, out)
    for name, (model, flags) in fine_tunes(s).items():
        fine_tune(name, out / model, out, s, *flags)


# ------------------------------------------------------------------ the bytes, checked

def parameter_count(safetensors: Path) -> int:
    import mlx.core as mx
    return sum(a.size for a in mx.load(str(safetensors)).values())


def expected_sync_bytes(values: int, workers: int) -> int:
    """What one worker sends in a mean of `values` fp16 values over `workers` (exchange/comm.py):
    the check's all-gather of 8 bytes per worker (its largest magnitude, from which every worker
    takes the shared unit, and its non-finite flag), then a ring all-reduce, 2(M-1)/M payloads of
    2 bytes a value (the fp16 codec's 4-byte unit is not sent: it is shared through the check)."""
    from mlx_diloco.exchange.codecs import CHECK_BYTES
    return 2 * (workers - 1) * (2 * values) // workers + (workers - 1) * CHECK_BYTES


def exchanges(summary: dict) -> list:
    """The run's exchanges.jsonl rows (a periodic strategy's: DiLoCo); None where the strategy
    exchanges every step (DDP) and writes none."""
    log = summary["run"] / "exchanges.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else None


def check_bytes(summary: dict, adapter_values: int, full_values: int) -> dict:
    """Bytes per sync measured (the run's total over its exchanges) against the formula, and each
    logged exchange's payload against 2 bytes an adapter value; asserted."""
    if summary["workers"] == 1:
        return dict(syncs=0, per_sync=0, share=None)
    rows = exchanges(summary)
    count = summary["steps"] if rows is None else len(rows)
    for row in rows or []:
        assert row["payload_bytes"] == 2 * adapter_values, f"{summary['run']}: payload {row}"
    per_sync = summary["bytes_sent_per_worker"] / count
    expected = expected_sync_bytes(adapter_values, summary["workers"])
    assert per_sync == expected, f"{summary['run']}: {per_sync} bytes per sync, expected {expected}"
    full = expected_sync_bytes(full_values, summary["workers"])
    return dict(syncs=count, per_sync=int(per_sync), share=per_sync / full)


# ------------------------------------------------------------------ 5. the report

def reply(base: Path, out: Path, prompt: str, adapters: Path = None) -> str:
    """mlx-lm's own generate (greedy, through the chat template), with the adapters if given: the
    reply to `prompt`."""
    log = out / "generate.log"
    cli(log, "python", "-m", "mlx_lm", "generate", "--model", base, "--prompt", prompt, "--max-tokens", 60,
        *(["--adapter-path", adapters] if adapters else []))
    text = log.read_text()
    return text.split("==========")[1].strip("\n") if text.count("==========") >= 2 else text


def table(rows: dict) -> list:
    """One line a run; "at step 0": the base's eval loss before fine-tuning."""
    lines = [f"{'run':14} {'workers':>7} {'strategy':>8} {'at step 0':>9} {'eval loss':>9} {'syncs':>5} "
             f"{'bytes/sync':>10} {'sent/worker':>12} {'of full model':>13} {'wall':>6}"]
    for name, (s, b) in rows.items():
        share = "-" if b["share"] is None else f"{b['share']:.2%}"
        lines.append(f"{name:14} {s['workers']:>7} {s['strategy']:>8} {s['start_eval_loss']:>9.4f} "
                     f"{s['final_eval_loss']:>9.4f} {b['syncs']:>5} {b['per_sync']:>10,} "
                     f"{s['bytes_sent_per_worker']:>12,} {share:>13} {s['wall_s']:>5.0f}s")
    return lines


def report(out: Path, s: dict, say):
    """The table, the bytes checked, a reply through mlx-lm, and the plot, from the runs in `out`."""
    base, chats = out / "base", out / "chats"
    pre, pre_config = run_summary(out / "pretrain"), json.loads((out / "pretrain" / "config.json").read_text())
    counts = {name: len((chats / f"{name}.jsonl").read_text().splitlines()) for name in ("train", "valid")}
    say(f"base: {MODEL} ({pre['parameters']:,} parameters) pretrained by one worker on the embedded Shakespeare, "
        f"{pre['steps']} steps of {pre_config['batch_size']} x {pre_config['seq_len']} tokens, "
        f"lr {pre_config['lr']:g}: eval loss {pre['final_eval_loss']:.4f} "
        f"({pre['wall_s']:.0f} s); exported by mlx-diloco export, and a chat template added to its "
        f"tokenizer_config.json (as anyone fine-tuning their own base for chat does):")
    say(CHAT_TEMPLATE, wrap=False)
    say(f"data: consecutive speeches of two speakers in the plays, the first as the user's message and the reply "
        f"as the assistant's, each with its speaker's header as in the corpus, at most {SEQ_LEN + 1} tokens "
        f"together: train.jsonl {counts['train']:,} chats from the first {VALID_FROM:.0%} of the text, valid.jsonl "
        f"{counts['valid']:,} from the rest")
    say(f"fine-tunes: LoRA rank 8 on all 4 blocks, --mask-prompt, {s['steps']} steps per worker, batch {BATCH} per "
        f"worker, seq-len {SEQ_LEN}, lr {LR:.0e} (warmup 50, cosine), seed 0, fp16 exchange; eval loss on the first "
        f"{s['eval_sequences']} chats of valid.jsonl. One worker: the same steps and batch as each of the 4 "
        f"(a quarter of their tokens). QLoRA: the base quantized by python -m mlx_lm convert -q --q-bits 4 "
        f"--q-group-size 64. wall: the run's own wall_s (from the model and data loaded to its last evaluation)")
    runs = {name: run_summary(out / name) for name in fine_tunes(s)}
    full = parameter_count(base / "model.safetensors")
    adapter_values = {name: parameter_count(r["run"] / "adapters" / "adapters.safetensors") for name, r in runs.items()}
    assert len(set(adapter_values.values())) == 1, adapter_values  # the same adapters on the 4-bit base
    adapters = adapter_values["diloco"]
    rows = {name: (r, check_bytes(r, adapters, full)) for name, r in runs.items()}
    say()
    for line in table(rows):
        say(line, wrap=False)
    say()
    say(f"bytes per sync, checked for every run (asserted): each exchange's payload is {adapters:,} adapter values "
        f"x 2 bytes (fp16) = {2 * adapters:,} B, and a worker sends 2(M-1)/M payloads (ring all-reduce) + (M-1) x 8 B "
        f"(the finiteness check; the fp16 codec's 4-byte unit is shared through it, not sent) = "
        f"{expected_sync_bytes(adapters, 4):,} B at M = 4; the full model ({full:,} values) would send "
        f"{expected_sync_bytes(full, 4):,} B per sync in the same codec")
    say(f"DiLoCo / DDP eval loss: {runs['diloco']['final_eval_loss'] / runs['ddp']['final_eval_loss']:.4f}; "
        f"DiLoCo sends {runs['ddp']['bytes_sent_per_worker'] / runs['diloco']['bytes_sent_per_worker']:.0f}x "
        f"fewer bytes")
    first = json.loads((chats / "valid.jsonl").read_text().splitlines()[0])["messages"]
    prompt, adapters_dir = first[0]["content"], runs["diloco"]["run"] / "adapters"
    say()
    say(f"the first chat of valid.jsonl through python -m mlx_lm generate --model {base} --prompt PROMPT "
        f"[--adapter-path {adapters_dir}]:")
    say(f"prompt:\n{prompt}\n\nthe play's reply:\n{first[1]['content']}", wrap=False)
    say(f"\nthe base model's, without the adapters:\n{reply(base, out, prompt)}", wrap=False)
    say(f"\nwith the DiLoCo adapters:\n{reply(base, out, prompt, adapters_dir)}", wrap=False)
    png = out / "finetune.png"
    cli(out / "plot.log", "mlx-diloco", "plot", *[r["run"] for r in runs.values()], "--out", png, "--title",
        f"LoRA chat fine-tune of {MODEL} on Shakespeare dialogue, {s['steps']} steps per worker")
    return png


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/finetune", help="folder for the runs, the base models and the data")
    p.add_argument("--quick", action="store_true", help="a smoke run: a few steps of each (results not written)")
    p.add_argument("--report-only", action="store_true", help="only the report, from the runs already in --out")
    args = p.parse_args()
    s, out = settings(args.quick), Path(args.out)
    if not args.report_only:
        train(out, s)
    lines = [f"$ python bench/finetune.py{' --quick' if args.quick else ''}", ""]

    def say(line="", wrap=True):
        line = textwrap.fill(line, 110) if wrap else line  # prose; not the table, the chats or the template
        print(line, flush=True)
        lines.append(line)

    png = report(out, s, say)
    if not args.quick:
        (RESULTS / "finetune.txt").write_text("\n".join(lines) + "\n")
        shutil.copy(png, RESULTS / "finetune.png")
        print(f"wrote {RESULTS / 'finetune.txt'} and {RESULTS / 'finetune.png'}")


if __name__ == "__main__":
    main()
