"""What a run writes down, each key declared once with a line of help, and read back by name:

    ROW          a metrics row (RUN/metrics.jsonl, one per evaluation), beside OBJECTIVE's keys
    SUMMARY      the run's summary (RUN/summary.json: sim's, Trainer.fit's and launch's alike)
    PROGRESS     a train report (callbacks' on_train_loss_report; a cluster worker's progress file)
    STOP         where a cluster worker stopped for a membership change (in its progress file)
    TIME         where a process's wall-clock went, part by part (the time_s of ROW, SUMMARY, PROGRESS)
    STATUS       a worker's row of RUN/status.json (run_status.py: the dashboard's workers)
    EXCHANGE     an exchange's row (RUN/exchanges.jsonl)
    HOP          a ring's hop into a rank (RUN/ring.json: the launcher's; the dashboard models sim's)
    EVENT        a cluster job's event (RUN/events.jsonl: the launcher's)
    CARD         a gym run's scorecard (RUN/scorecard.json)
    MLX_LM       a report in mlx-lm's keys, for report-to's loggers (training/callbacks.py)
    CHECKPOINT   a checkpoint's arrays (training/checkpoint.py), its workers' part WORKER_ARRAYS
    META         a checkpoint's meta (ckpt-STEP.json; run_folder.py reads it), OPTIONAL_META beside it

Each is a `Record`: `ROW.eval_loss` is the key's name (a misspelled one is an AttributeError naming
the record), so a reader writes `row[ROW.eval_loss]` and a writer `ROW.check(values)` (or the
builders below, which refuse a key not declared: tests/test_records.py checks a run writes exactly
these). MLX-free.
"""

from dataclasses import dataclass


class Record(dict):
    """The keys of one kind of record, {key: its help}. `RECORD.key` is the key's own name; `also`:
    records whose keys this one may hold beside its own (the objectives' metrics in a row)."""

    def __init__(self, name: str, keys: dict, also: tuple = ()):
        super().__init__(keys)
        self._name = name
        self._also = {k: v for record in also for k, v in record.items()}

    def __getattr__(self, key: str) -> str:
        if key.startswith("_"):
            raise AttributeError(key)
        if key in self or key in self._also:
            return key
        raise AttributeError(f"a {self._name} has no key '{key}' (records.py declares its keys)")

    def declares(self, key: str) -> bool:
        return key in self or key in self._also

    def check(self, values: dict) -> dict:
        """`values`, once every key is one this record declares (else a KeyError naming the stray ones)."""
        if stray := [k for k in values if not self.declares(k)]:
            raise KeyError(f"{self._name} keys not declared in records.py: {', '.join(stray)}")
        return values

    def ordered(self, values: dict) -> dict:
        """`values` checked, in this record's order (the `also` keys after its own)."""
        self.check(values)
        return {**{k: values[k] for k in self if k in values}, **{k: v for k, v in values.items() if k not in self}}

    def complete(self, values: dict) -> dict:
        """`values` checked, with every key of this record (in its order; None where not given) and the
        `also` keys given after them."""
        self.check(values)
        return {**{k: values.get(k) for k in self}, **{k: v for k, v in values.items() if k not in self}}


# An objective's own metrics (objectives/): in its rows beside ROW's, and those of its `summary_keys`
# in the summary (DPO's and ORPO's as TRL names them, GRPO's as TRL's GRPOTrainer logs them).
OBJECTIVE = Record("objective metric", {
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
})

# Where a process's wall-clock went (training/clock.py), every second in one part: a row's, a summary's
# and a train report's `time_s`, which sum to their `process_s`.
TIME = Record("time split", {
    "startup_s": "from the process's start to its first step: imports, the model, the data, a resume's "
                 "checkpoint, a new ring's catch-up",
    "compute_s": "the steps' own work: the inner steps, the strategy's outer steps and codecs, the reports",
    "generate_s": "generating what a step trains on (GRPO's rollouts and rewards, DPO's reference passes)",
    "link_s": "waiting for the link in exchanges",
    "straggler_s": "waiting for slower workers in exchanges",
    "save_s": "checkpoints, and an elastic cluster worker's saves of its own state",
    "eval_s": "evaluations (the held-out losses, the workers' metrics gathered) and the summary",
    "restart_s": "a cluster job's restarts and membership changes: no ring trained (the launcher's)",
})

# The parts' names for people (the dashboard, the summary printed), in the order they are shown.
TIME_NAMES = {TIME.startup_s: "start-up", TIME.compute_s: "compute", TIME.generate_s: "generation",
              TIME.link_s: "the link", TIME.straggler_s: "slower workers", TIME.save_s: "saves",
              TIME.eval_s: "evaluation", TIME.restart_s: "restarts"}

ROW = Record("metrics row", {
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
    "process_s": "seconds since the processes started (their mean; over resumes): the wall-clock time_s splits",
    "time_s": "where the processes' wall-clock went, by part (TIME; their mean, s)",
    "time": "the Unix time of the row",
    "peak_memory_bytes": "MLX's peak memory of the largest process",
    "workers_per_process": "workers one process trains",
    "strategy": "the strategy's name",
    "workers": "the config's workers (slots)",
    "sync_every": "H: inner steps between syncs (0: none)",
    "link": "the modelled link's name",
    "strategy_options": "the strategy's options, as resolved",
    "objective": "what the run optimizes: sft, dpo, orpo or grpo (objectives/)",
}, also=(OBJECTIVE,))

SUMMARY = Record("summary", {
    "run_dir": "the run folder",
    "strategy": ROW["strategy"],
    "workers": "the config's workers (slots); a cluster job's: the members at its end",
    "steps": "steps done",
    "parameters": "the model's parameters (None: not known where the summary is written, the launcher)",
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
    "wall_s": ROW["wall_s"],
    "process_s": "the run's wall-clock: its processes' (their mean, over resumes); a cluster job's, the launcher's",
    "time_s": "where that wall-clock went, by part (TIME, s); a cluster job's: rank 0's and the launcher's",
    "job": "a cluster job's name (None off a cluster)",
    "restarts": "restarts of a cluster job's ring after a failure (0 off a cluster)",
    "restart_s": "seconds a cluster job did not train while its ring was restarted or changed (0 off a cluster)",
    "changes": "a cluster job's restarts and membership changes, each with what it cost (events.jsonl's)",
}, also=(OBJECTIVE,))

PROGRESS = Record("train report", {
    "step": "the job-wide step just taken",
    "steps": "the run's steps",
    "loss": "the mean of this step's local losses",
    "worker_losses": "each local worker's loss (None for one that did not train at this step)",
    "tokens_per_s": "this process's tokens per second at this step",
    "job_tokens_per_s": "the whole job's tokens per second at this step",
    "sync_s": "time this process spent waiting for exchanges so far (s)",
    "bytes_sent": "bytes one worker sent so far",
    "compute_s": "this process's measured compute time so far, all its workers (s)",
    "link_s": "time this process waited for the link so far (s)",
    "straggler_s": "time this process waited for slower workers so far (s)",
    "mfu": "this process's model FLOPs utilisation over its wall-clock time",
    "memory_bytes": "MLX's active memory now",
    "memory_limit_bytes": "the config's memory limit (None: MLX's default)",
    "process_s": "seconds since this process started (over resumes): the wall-clock time_s splits",
    "time_s": "where this process's wall-clock went, by part (TIME, s)",
    "time": "the Unix time of the report (a progress file's)",
    "stopped": "where this cluster worker stopped for a membership change (STOP; a progress file's)",
})

STOP = Record("stop for a membership change", {
    "step": "the last step the worker took",
    "why": "why it stopped",
    "members": "the job's members from the next step on",
    "time": "the Unix time it stopped",
})

STATUS = Record("status row", {
    "worker": "the worker's slot (None: a machine waiting to join, without one yet)",
    "rank": "its rank in the ring (a cluster's members)",
    "host": "its machine",
    "state": "what it is doing (run_status.STATES)",
    "step": PROGRESS["step"],
    "steps_per_s": "its steps per second over the last few seconds",
    "tokens_per_s": "its tokens per second",
    "loss": "its last training loss",
    "sync_s": PROGRESS["sync_s"],
    "bytes_sent": PROGRESS["bytes_sent"],
    "compute_s": PROGRESS["compute_s"],
    "link_s": PROGRESS["link_s"],
    "straggler_s": PROGRESS["straggler_s"],
    "restart_s": SUMMARY["restart_s"],
    "mfu": PROGRESS["mfu"],
    "memory_bytes": PROGRESS["memory_bytes"],
    "memory_limit_bytes": "the memory it may use: the config's limit, or what its machine offers",
    "process_s": PROGRESS["process_s"],
    "time_s": PROGRESS["time_s"],
})

EXCHANGE = Record("exchange row", {
    "step": "the step at which the exchange finished",
    "what": "what was exchanged (the strategy's tag)",
    "codec": "the codec it was sent in",
    "algorithm": "how it travelled (ring all-reduce, gather, quantized ring, ...)",
    "payload_bytes": "the values' bytes before the codec",
    "sent_bytes": "the bytes one worker sent",
    "overlap_steps": "inner steps of compute that ran while it travelled",
    "modelled_s": "its time on the config's link (network.py's model)",
    "exposed_s": "the part of modelled_s that the overlapped steps do not hide",
    "blocked_s": "measured time this process was blocked in it (starting it and waiting for its result)",
    "straggler_s": "of blocked_s, the time waiting for slower workers",
})

HOP = Record("ring hop", {
    "rank": "the rank the hop goes into (from rank - 1)",
    "worker": STATUS["worker"],
    "host": STATUS["host"],
    "address": "where the rank listens",
    "kind": "the link's kind (thunderbolt, ethernet, wi-fi, ...; a sim run's: its modelled link)",
    "gbps": "the link's bus bandwidth as measured (Gbit/s; None: not measured)",
    "latency_ms": "the link's latency as measured (ms; None: not measured)",
    "modelled": "the link is the config's modelled one (a sim run's ring)",
})

EVENT = Record("cluster event", {
    "time": "the Unix time of the event",
    "event": "what happened: started, shipped, failure, left, joining, joined, restarted, membership_change, ...",
    "workers": "the ring's workers after it",
    "worker": "the slot it concerns",
    "host": "the machine it concerns",
    "step": "the step it happened at",
    "bytes": "bytes shipped",
    "why": "what failed, or why a machine was refused",
    "lost": "the workers lost",
    "after_step": "a joiner is admitted at the first sync point from this step on",
    "resume_step": "the step each worker resumes from",
    "ring": "the ring, rank by rank, with each hop's link",
    "backend": "the ring's backend (ring, jaccl)",
    "backend_reason": "why that backend",
    "pairs": "each pair of machines' measured link",
    "during": "what the launcher was doing when it died",
    "change": "the kind of change: restart, lost, join, planned",
    "stop_s": "from the first worker stopping training to every worker stopped (s)",
    "start_s": "from every worker stopped to the new ring started (s)",
    "first_step_s": "from the new ring started to its every worker's first step (s)",
    "total_s": "the change's whole cost: time the job did not train (s)",
    "redone_steps": "each worker's steps redone (taken again after the state it resumed from)",
})

CARD = Record("scorecard", {
    "problem": "the gym problem (None: a run scored against a given target)",
    "run_dir": SUMMARY["run_dir"],
    "strategy": ROW["strategy"],
    "label": "the strategy and the options that set the run apart",
    "workers": ROW["workers"],
    "steps": SUMMARY["steps"],
    "tokens": ROW["tokens"],
    "examples": ROW["examples"],
    "examples_to_target": "examples trained until the eval loss first reached the target (None: not reached)",
    "final_eval_loss": SUMMARY["final_eval_loss"],
    "target_loss": "the problem's target eval loss",
    "steps_to_target": "steps until the eval loss first reached the target (None: not reached)",
    "tokens_to_target": "tokens trained until then",
    "modelled_s_to_target": "modelled seconds until then",
    "modelled_s": ROW["modelled_time_s"],
    "link": ROW["link"],
    "bytes_sent_per_worker": ROW["bytes_sent_per_worker"],
    "peak_exchange_bytes": ROW["peak_exchange_bytes"],
    "utilisation": ROW["utilisation"],
    "idle_fraction": ROW["idle_fraction"],
    "measured_utilisation": ROW["measured_utilisation"],
    "busy_s": ROW["busy_s"],
    "link_s": ROW["link_s"],
    "straggler_s": ROW["straggler_s"],
    "mfu": ROW["mfu"],
    "worker_spread": "how far the workers' models were apart: their eval losses' max - min, mean over the evaluations",
    "wall_s": ROW["wall_s"],
    "strategy_options": ROW["strategy_options"],
    "worker_speeds": "the config's worker speeds",
    "speed_policy": "the config's speed policy",
    "objective": ROW["objective"],
    "eval_accuracy_start": "GRPO: the held-out accuracy before training",
    "eval_pair_accuracy_start": "DPO, ORPO: the held-out pair accuracy before training",
    "eval_reward_accuracy_start": "DPO: the held-out reward accuracy before training",
    "point": "a sweep's point: the settings this run took (gym/sweep.py)",
}, also=(OBJECTIVE,))

# mlx-lm's own keys (tuner/trainer.py's train_info and val_info), which its reporting callbacks log.
MLX_LM = Record("mlx-lm report", {
    "iteration": "the step",
    "train_loss": "PROGRESS's loss",
    "tokens_per_second": "the whole job's tokens per second",
    "val_loss": "the global model's eval loss",
    "trained_tokens": "tokens trained by all workers so far",
    "peak_memory": "peak memory (GB)",
}, also=(PROGRESS, ROW))

WORKER_ARRAYS = Record("checkpoint's workers", {
    "params": "each local worker's weights (a leading worker axis)",
    "inner": "their inner optimizer's state",
})

CHECKPOINT = Record("checkpoint's arrays", {
    "workers": "each local worker's training state (WORKER_ARRAYS)",
    "strategy": "the strategy's state (the global model, outer optimizer, exchanges in flight: Strategy.state())",
})

# A checkpoint's meta (ckpt-STEP.json): every key, always present. A change here is a new LAYOUT (run_folder.py).
META = Record("checkpoint meta", {
    "layout": "the layout that wrote it (LAYOUT); the versions before layouts had none: 1",
    "step": "steps taken",
    "config": "the run's config, flat (TrainConfig.to_dict())",
    "cursors": "each local worker's data sampler state, a list",
    "compute_s": "seconds spent computing so far, a float",
    "worker_speeds": "the workers' measured relative speeds, a list, or None",
    "exchanges": "the exchange ledger's state (ExchangeLedger.state())",
    "model_preset": "the model's preset, a dict, or None (a model folder)",
    "vocab_size": "the data's vocabulary size, an int, or None",
})
# Keys a checkpoint's meta may lack (those written before them did).
OPTIONAL_META = Record("checkpoint meta", {
    "waits_s": "seconds this worker waited on its peers so far: for the link ('link_s') and for slower "
               "workers ('straggler_s')",
    "membership": "an elastic cluster worker's: the slots of its ring's workers ('ring_slots') and who left "
                  "and joined so far ('history', membership.py's syntax)",
    "objective": "a post-training objective's running totals (objectives/: each local worker's tokens generated "
                 "and trained, seconds generating and training), a dict",
    "time_s": "this worker's processes' time split so far (TIME), and their wall-clock (process_s)",
})


@dataclass
class SavedArrays:
    """A checkpoint's arrays, read by name: the local workers' weights and inner optimizer state, and
    the strategy's own state (its `state()`)."""
    params: dict
    inner: dict
    strategy: dict

    @classmethod
    def of(cls, arrays: dict) -> "SavedArrays":
        workers = arrays[CHECKPOINT.workers]
        return cls(workers[WORKER_ARRAYS.params], workers[WORKER_ARRAYS.inner], arrays.get(CHECKPOINT.strategy, {}))

    def arrays(self) -> dict:
        """The tree a checkpoint writes (CHECKPOINT)."""
        return {CHECKPOINT.workers: {WORKER_ARRAYS.params: self.params, WORKER_ARRAYS.inner: self.inner},
                CHECKPOINT.strategy: self.strategy}


def metrics_row(**values) -> dict:
    """A metrics row, its keys checked against ROW (and OBJECTIVE), in ROW's order."""
    return ROW.ordered(values)


def run_summary(**values) -> dict:
    """A run's summary, its keys checked against SUMMARY (and OBJECTIVE): every key of SUMMARY, in its
    order, None where the writer does not know it (the launcher does not see the model)."""
    return SUMMARY.complete(values)
