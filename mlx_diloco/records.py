"""What a run writes down, each key declared once with a line of help: a metrics row (RUN/metrics.jsonl,
one per evaluation), the summary (RUN/summary.json, `Trainer.fit`'s and `sim`'s) and a checkpoint's
arrays (training/checkpoint.py). The run builds its rows and summary through `metrics_row` and
`run_summary`, which refuse a key not declared here (tests/test_records.py: a run writes exactly
these keys); readers (dashboard, scorecards, plots, the API, the launcher) look keys up here.
MLX-free.
"""

ROW = {
    "step": "the job-wide step of the evaluation (0: before training)",
    "outer_step": "outer steps (syncs) done by then",
    "tokens": "tokens trained by all workers so far (None for data that is not tokens)",
    "examples": "examples (sequences, images) trained by all workers so far",
    "eval_loss": "the global model's loss on the held-out batches",
    "eval_loss_workers": "each worker's own model's held-out loss (NaN where a slot has no member)",
    "train_loss": "the mean training loss since the last evaluation",
    "train_loss_workers": "each worker's mean training loss since the last evaluation",
    "members": "workers that are members at this step (a membership schedule)",
    "tokens_per_shard": "tokens trained from each worker's data shard",
    "inner_steps_lost": "each slot's inner steps that never reached the global model (a worker that left)",
    "membership_changes": "who left and joined since the last evaluation",
    "bytes_sent_per_worker": "bytes one worker sent so far",
    "peak_exchange_bytes": "the largest exchange's bytes",
    "compute_s": "measured compute time of one worker (s)",
    "comm_s": "modelled time on the config's link of the exchanges so far (s)",
    "modelled_time_s": "compute_s + comm_s: the run's modelled wall-clock time (s)",
    "sync_wait_s": "measured time waiting in exchanges (s)",
    "utilisation": "modelled: the share of the time the workers compute (not waiting for the link or slower workers)",
    "idle_fraction": "the share of worker ticks spent waiting for slower workers (worker speeds)",
    "worker_speeds": "each worker's relative speed (None: all alike)",
    "measured_utilisation": "busy_s over busy_s + link_s + straggler_s",
    "busy_s": "the processes' measured compute time (mean over them, s)",
    "link_s": "time waiting for the link (mean over the processes, s)",
    "straggler_s": "time waiting for slower workers (mean over the processes, s)",
    "mfu": "model FLOPs utilisation against the device's peak (None: not a language model)",
    "flops_per_token": "training FLOPs per token of the model as built",
    "peak_gflops": "the device's measured matmul peak (GFLOP/s)",
    "wall_s": "seconds since this process started the run",
    "time": "the Unix time of the row",
    "peak_memory_bytes": "MLX's peak memory of the largest process",
    "workers_per_process": "workers one process trains",
    "strategy": "the strategy's name",
    "workers": "the config's workers (slots)",
    "sync_every": "H: inner steps between syncs (0: none)",
    "link": "the modelled link's name",
    "strategy_options": "the strategy's options, as resolved",
    "objective": "what the run optimizes: sft, dpo, orpo or grpo (objectives/)",
}

# An objective's own metrics (objectives/): in its rows beside ROW's, and those of its `summary_keys`
# in the summary (DPO's and ORPO's as TRL names them, GRPO's as TRL's GRPOTrainer logs them).
OBJECTIVE = {
    "tokens_trained": "completion tokens trained so far, all workers",
    "reference_s": "time spent on the reference model's log-probabilities so far (mean over workers, s)",
    "eval_pair_accuracy": "held-out pairs whose chosen completion the global model finds likelier than the rejected",
    "eval_logps_chosen": "the global model's mean log-probability of the held-out chosen completions (summed "
                         "over each one's tokens): below the start's, the preference is learnt by unlearning the answer",
    "eval_logps_rejected": "the same for the held-out rejected completions",
    "eval_rewards_chosen": "DPO: mean beta x (policy - reference log-probability) of the held-out chosen completions",
    "eval_rewards_rejected": "DPO: the same for the rejected completions",
    "eval_reward_margin": "DPO: the mean of chosen minus rejected rewards, held out",
    "eval_reward_accuracy": "DPO: the share of held-out pairs whose chosen reward is above the rejected one",
    "reward": "GRPO: the mean reward of the completions since the last evaluation",
    "reward_workers": "GRPO: each worker's mean reward since the last evaluation",
    "reward_std": "GRPO: the mean standard deviation of the rewards within a group",
    "reward_std_workers": "GRPO: each worker's mean within-group standard deviation",
    "frac_reward_zero_std": "GRPO: the share of groups whose rewards are all equal (zero advantage)",
    "completion_length": "GRPO: the mean completion length (tokens)",
    "completions_clipped": "GRPO: the share of completions cut at the token limit",
    "kl": "GRPO: the mean KL to the reference (k3 estimator) over the workers",
    "kl_workers": "GRPO: each worker's KL to the reference",
    "tokens_generated": "GRPO: completion tokens generated so far, all workers",
    "generate_s": "GRPO: time spent generating so far (mean over workers, s)",
    "train_s": "GRPO: time spent training so far (mean over workers, s)",
    "eval_accuracy": "GRPO: the share of held-out prompts the global model answers exactly (greedy)",
    "collapse": "GRPO: '' or why the run is collapsing (held-out accuracy or reward below half their best, the KL "
                "to the reference above its value then)",
    "eval_reward": "GRPO: the mean reward of the global model's greedy held-out completions",
}

SUMMARY = {
    "run_dir": "the run folder",
    "strategy": ROW["strategy"],
    "workers": ROW["workers"],
    "steps": "steps done",
    "parameters": "the model's parameters",
    "final_eval_loss": "the last row's eval_loss",
    "tokens": ROW["tokens"],
    "examples": ROW["examples"],
    "tokens_per_shard": ROW["tokens_per_shard"],
    "examples_per_shard": "examples trained from each worker's data shard",
    "inner_steps_lost": ROW["inner_steps_lost"],
    "bytes_sent_per_worker": ROW["bytes_sent_per_worker"],
    "peak_exchange_bytes": ROW["peak_exchange_bytes"],
    "compute_s": ROW["compute_s"],
    "modelled_comm_s": ROW["comm_s"],
    "utilisation": ROW["utilisation"],
    "link": "the modelled link, described",
    "measured_utilisation": ROW["measured_utilisation"],
    "busy_s": ROW["busy_s"],
    "link_s": ROW["link_s"],
    "straggler_s": ROW["straggler_s"],
    "mfu": ROW["mfu"],
    "flops_per_token": ROW["flops_per_token"],
    "peak_gflops": ROW["peak_gflops"],
    "peak_memory_bytes": "the run's peak memory, over its processes and resumes",
    "workers_per_process": ROW["workers_per_process"],
    "eval_examples": "the held-out examples every evaluation scores: the first ones of the held-out split, "
                     "the same whatever the batch size, worker count or strategy (--eval-sequences)",
    "kernels": "what the model ran on (models/kernels.py)",
    "inner_step": "how the inner step ran (vmapped, compiled)",
}

CHECKPOINT = {
    "workers": "each local worker's training state: {'params': its weights, 'inner': its inner optimizer's state}",
    "strategy": "the strategy's state (the global model, outer optimizer, exchanges in flight: Strategy.state())",
}


def _declared(values: dict, declared: dict, what: str) -> dict:
    """`values`, once every key is one `declared` lists (else a KeyError naming the stray ones)."""
    if stray := [k for k in values if k not in declared]:
        raise KeyError(f"{what} keys not declared in records.py: {', '.join(stray)}")
    return values


def metrics_row(**values) -> dict:
    """A metrics row, its keys checked against ROW (and OBJECTIVE)."""
    return _declared(values, {**ROW, **OBJECTIVE}, "metrics row")


def run_summary(**values) -> dict:
    """A run's summary, its keys checked against SUMMARY (and OBJECTIVE)."""
    return _declared(values, {**SUMMARY, **OBJECTIVE}, "summary")
