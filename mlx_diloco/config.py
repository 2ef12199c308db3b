"""Run configuration: one dataclass with every training setting, each declared once with its
help (`option`): the command line's flags, the Python API's arguments and `plan`'s are derived
from these fields. Checked on the way in: names, types and ranges of the config's own keys.

Below it: options.py (errors, typed values, did-you-mean), exchange/network.py, speeds.py and
membership.py (which parse the link, the worker speeds and the membership schedule). It imports
nothing above them: every other key of a flat config is a strategy option, which the strategy
checks where it is built (training/resolve.py's `resolve`, which turns a config into the run's
config, strategy and model spec)."""

import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .exchange.network import parse_link
from .schedules.membership import Schedule, check_strategy as check_membership
from .mlx_lm_config import read_yaml_config
from .objectives.kinds import DEFAULT as DEFAULT_OBJECTIVE, OBJECTIVES
from .options import ConfigError, from_dict, option, read_json, shown  # ConfigError: most callers import it from here
from .schedules.speeds import Speeds


PRECISIONS = ("fp32", "bf16")
FINE_TUNE_TYPES = ("full", "lora", "dora")  # mlx-lm's names (models/finetune.py)
REPORTERS = ("wandb", "swanlab")  # mlx-lm's get_reporting_callbacks (training/callbacks.py)
MAX_AUTO_WARMUP = 50  # warmup -1: a fifth of the run, at most this many steps (TrainConfig.warmup_steps)
DEFAULT_MAX_SEQ_LEN = 1024  # what seq-len 0 stands for at most (a model folder may allow 32K)
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "grpo": 0.0}  # TRL's (mlx-lm-lora's GRPO: 0.1)
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
BUILT_IN_REWARDS = ("exact_answer", "number_match", "format", "length")  # objectives/rewards.py


def held_out_in_sequences(params: dict) -> dict:
    """`eval_batches` K (mlx-lm's val_batches; run folders from before eval_sequences) is K batches of
    the run's batch size: the same held-out examples as eval_sequences = K x batch_size."""
    if "eval_batches" not in params:
        return params
    if "eval_sequences" in params:
        raise ConfigError("give eval_sequences or eval_batches (batches of batch_size), not both")
    batches, batch = params["eval_batches"], params.get("batch_size", TrainConfig.batch_size)
    if type(batches) is not int or type(batch) is not int:
        raise ConfigError(f"eval_batches must be a whole number of batches (got {shown(batches)}); "
                          "or give eval_sequences, the held-out examples per evaluation")
    return {**{k: v for k, v in params.items() if k != "eval_batches"}, "eval_sequences": batches * batch}


@dataclass
class TrainConfig:
    # What to train on
    model: str = option("small", "model preset name (see models/), a preset .json file, an mlx-lm model folder, "
                                 "or a Hugging Face model ORG/NAME (this machine's Hugging Face cache)")
    data: str = option("shakespeare", "'shakespeare' (embedded), 'fashion-mnist', a text file, a folder "
                                      "of .txt files, or mlx-lm's JSONL: a .jsonl file or a folder with "
                                      "train.jsonl and valid.jsonl (docs/data.md)")
    mask_prompt: bool = option(False, "JSONL chat or prompt/completion data: the loss on the completion only "
                                      "(the last message), not the prompt")
    tokenizer: str = option("", "HF/mlx-lm tokenizer folder (default: train a byte-level BPE on the corpus)")
    seq_len: int = option(0, f"tokens per training sequence (0: the model's context, at most {DEFAULT_MAX_SEQ_LEN})")
    batch_size: int = option(16, "sequences per worker per inner step")
    # Fine-tuning (models/finetune.py), with mlx_lm.lora's names and defaults
    fine_tune_type: str = option("full", "full (every weight trains), or lora / dora: adapters on the linear layers "
                                         "of the last num-layers blocks, the base frozen (a quantized base: QLoRA)")
    num_layers: int = option(16, "lora/dora: blocks that get adapters, from the last (-1: all)")
    lora_rank: int = option(8, "lora/dora: the adapters' rank")
    lora_scale: float = option(20.0, "lora/dora: the scale of the adapters' output")
    lora_dropout: float = option(0.0, "lora/dora: dropout on the adapters' input")
    lora_keys: str = option("", "lora/dora: the layers that get adapters, comma-separated paths in a block, e.g. "
                                "self_attn.q_proj,self_attn.v_proj (mlx-lm's lora_parameters.keys; '': every "
                                "linear layer)")
    # Post-training objectives (objectives/; docs/post-training.md), under mlx-lm-lora's and TRL's names
    objective: str = option(DEFAULT_OBJECTIVE, "sft (next-token loss on the data), dpo or orpo (JSONL of prompt, chosen, "
                                   "rejected), grpo (JSONL of prompt, answer: completions sampled and rewarded); "
                                   "mlx-lm-lora's train_mode")
    beta: float = option(-1.0, "dpo: the loss's beta; orpo: the odds-ratio term's weight (lambda); grpo: the KL "
                               "penalty's weight, 0 for none (-1: TRL's defaults: 0.1, 0.1, 0.0)")
    rpo_alpha: float = option(0.0, "dpo: weight of an NLL term on the chosen completions (RPO, arXiv 2404.19733; "
                                   "TRL's rpo_alpha), against DPO unlearning them (0: plain DPO)")
    group_size: int = option(4, "grpo: completions sampled per prompt (TRL's num_generations)")
    max_completion_length: int = option(512, "grpo: the most tokens a sampled completion has")
    temperature: float = option(1.0, "grpo: the sampling temperature (the loss's log-probabilities divide "
                                     "the logits by it too, as TRL's)")
    top_p: float = option(1.0, "grpo: nucleus sampling's probability mass (1: off)")
    epsilon: float = option(0.2, "grpo: the policy ratio's clip below 1 (PPO's epsilon)")
    epsilon_high: float = option(0.0, "grpo: the ratio's clip above 1 (DAPO: 0.28; 0: epsilon)")
    grpo_loss_type: str = option("grpo", "grpo (each completion's token mean, then their mean), bnpo or dapo "
                                         "(the token mean over the worker's batch), dr_grpo (the token sum over "
                                         "completions x max-completion-length: Dr. GRPO)")
    scale_rewards: str = option("", "grpo: advantages divided by the std of the group's rewards (group), of "
                                    "the batch's (batch), or not (none) ('': group; none with dr_grpo)")
    reward_functions: str = option("", "grpo: reward functions, comma-separated: built-ins "
                                       f"{', '.join(BUILT_IN_REWARDS)} or the reward file's own "
                                       "('': exact_answer, or every function of the reward file)")
    reward_weights: str = option("", "grpo: one weight per reward function, comma-separated ('': all 1)")
    reward_file: str = option("", "grpo: a Python file of reward functions "
                                  "f(prompts, completions, answer, **kwargs) -> a list of floats (mlx-lm-lora's "
                                  "and TRL's signature)")
    reward_format: str = option("", "grpo: the format reward's regular expression, matched against the whole "
                                    "completion")
    # The simulated (or real) cluster, and the strategy (strategies/: its options are its own)
    workers: int = option(4, "number of (simulated) workers")
    strategy: str = option("diloco", "training strategy")  # the command line lists the registered ones
    strategy_options: dict = option({}, "the strategy's options, e.g. {\"sync_every\": 50}; flat in files and flags")
    steps: int = option(500, "inner steps per worker")
    # Inner optimizer: AdamW with PyTorch-equivalent settings
    lr: float = option(1e-3, "peak inner learning rate")
    warmup: int = option(-1, "linear warmup steps before the cosine decay "
                             f"(-1: a fifth of the steps, at most {MAX_AUTO_WARMUP})")
    final_lr: float = option(0.1, "where the cosine decay ends, a fraction of the peak lr (the DiLoCo "
                                  "scaling-law paper, arXiv 2503.09799: 0.05)")
    weight_decay: float = option(0.1, "inner weight decay")
    beta1: float = option(0.9, "inner AdamW beta1")
    beta2: float = option(0.95, "inner AdamW beta2")
    grad_clip: float = option(1.0, "per-worker gradient norm clip (0 disables)")
    # Evaluation, bookkeeping
    eval_every: int = option(0, "inner steps between evaluations (0: every outer step, or 50 without one)")
    eval_sequences: int = option(128, "held-out examples per evaluation: the first N of the held-out split, the "
                                      "same text whatever the batch size, worker count or strategy")
    seed: int = option(0, "random seed (model init, data order)")
    link: str = option("1gbe", "network for the time model: tb5, tb4, 10gbe, 1gbe, wifi, internet, or e.g. "
                               "'100mbit/20ms'")
    step_time: float = option(0.0, "modelled seconds per inner step of a speed-1 worker, for the time model "
                                   "(0: as measured)")
    worker_speeds: str = option("", "relative worker speeds, one per worker, e.g. 1,1,0.5,0.25 "
                                    "(simulates a mixed cluster)")
    speed_policy: str = option("fixed", "with worker speeds: fixed (H steps each; fast workers wait) or time "
                                        "(each worker takes the steps that fit a round; speeds.py)")
    membership: str = option("", "workers leaving and joining mid-run, STEP:WORKERS pairs, e.g. 0:4,300:3,600:4, "
                                 "or STEP:-SLOT / STEP:+SLOT for a named slot: "
                                 "a leaver's round is lost, a joiner starts from the global model at the next "
                                 "sync (membership.py; '': fixed)")
    vectorize: bool = option(True, "train simulated workers together with mx.vmap (--no-vectorize: one after another)")
    loss: str = option("", "loss function 'package.module:function' taking (model, x, y) (default: cross-entropy)")
    # Memory (issue 11): what the replicas are stored and computed in
    precision: str = option("fp32", "fp32, or bf16: weights, activations and gradients in bfloat16 "
                                    "(AdamW moments stay fp32; models/precision.py)")
    moments_precision: str = option("fp32", "AdamW moments in fp32, or bf16 (half their memory)")
    grad_checkpoint: bool = option(False, "recompute each block's activations in the backward pass: less memory, "
                                          "one more forward pass (models/checkpointing.py)")
    memory_limit: float = option(0.0, "GB this process keeps to: MLX waits for work in flight instead of "
                                      "allocating past it (0: MLX's default)")
    report_to: str = option("", "loggers, as mlx_lm.lora's: wandb, swanlab, or both comma-separated (pip install "
                                "wandb / swanlab); the reporting process logs every step's loss and every evaluation")
    project_name: str = option("", "with report-to: the logger's project (mlx-lm's project_name; '': its default)")

    @classmethod
    def from_dict(cls, params: dict) -> "TrainConfig":
        """Config keys and the strategy's options side by side ({"strategy": "diloco", "sync_every": 50}):
        the config's own keys are checked here (names, types, ranges); every other key is kept as a
        strategy option, which `strategies.make_strategy` checks where the run builds its strategy
        (training/resolve.py). The agent reads configs so, without MLX."""
        if not isinstance(params, dict):
            return from_dict(cls, params, what="config key")  # the one-line error for a non-object
        own = {f.name for f in fields(cls)} - {"strategy_options"}
        options = params.get("strategy_options") or {}
        if not isinstance(options, dict):
            raise ConfigError(f"strategy_options must be a JSON object ({{\"sync_every\": 50, ...}}), "
                              f"not a {type(options).__name__}")
        params = held_out_in_sequences(params)
        config = from_dict(cls, {k: v for k, v in params.items() if k in own}, what="config key")
        config.strategy_options = {**options, **{k: v for k, v in params.items()
                                                 if k not in own and k != "strategy_options"}}
        config.check_values()
        return config

    @classmethod
    def from_file(cls, path) -> "TrainConfig":
        """A JSON config, or a YAML one (.yaml, .yml) that may use mlx_lm.lora's keys (mlx_lm_config.py)."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass the path of a JSON or YAML config")
        if path.suffix.lower() in (".yaml", ".yml"):
            return cls.from_dict(read_yaml_config(path, {f.name for f in fields(cls)} | {"eval_batches"}))
        return cls.from_dict(read_json(path, "a config file", 'pass a JSON config ({"workers": 4, ...})'))

    def to_dict(self) -> dict:
        """Flat, as in config files: the strategy's options beside the config keys."""
        flat = asdict(self)
        return {**{k: v for k, v in flat.items() if k != "strategy_options"}, **flat["strategy_options"]}

    def warmup_steps(self) -> int:
        """The learning rate's warmup in steps: as set, or (-1) a fifth of the run, at most 50 steps,
        so that a short run is not spent warming up (60 steps: 12, not 50; 250 steps or more: 50)."""
        return self.warmup if self.warmup >= 0 else min(MAX_AUTO_WARMUP, self.steps // 5)

    def objective_beta(self) -> float:
        """beta as set, or (-1) the objective's default, TRL's."""
        return self.beta if self.beta >= 0 else DEFAULT_BETA.get(self.objective, 0.0)

    def reward_scaling(self) -> str:
        """What GRPO's advantages are divided by: as set, or the group's std (none under Dr. GRPO,
        whose paper drops both the length and the std normalization)."""
        return self.scale_rewards or ("none" if self.grpo_loss_type == "dr_grpo" else "group")

    def reward_names(self) -> list:
        return [name.strip() for name in self.reward_functions.split(",") if name.strip()]

    def reward_weight_values(self) -> list:
        """reward-weights as numbers ([]: all 1)."""
        try:
            weights = [float(w) for w in self.reward_weights.split(",") if w.strip()]
        except ValueError:
            weights = [math.nan]
        if not all(map(math.isfinite, weights)):  # a NaN weight zeroed every reward (nansum), an inf made them NaN
            raise ConfigError(f"reward-weights must be finite numbers, comma-separated (e.g. 1,0.5), not "
                              f"'{self.reward_weights}'")
        return weights

    def reporters(self) -> list:
        """The loggers of report-to, as mlx-lm splits them ("wandb, swanlab": both)."""
        return [name.strip().lower() for name in self.report_to.split(",") if name.strip()]

    def check_strategy(self, strategy):
        """What the config asks of its strategy (built from it: training/resolve.py): speed-policy
        time paces workers between syncs, so the strategy must exchange nothing between them, and
        every worker must step in a round. A membership schedule (membership.py) needs such a strategy too."""
        if Schedule.of(self):
            check_membership(strategy)
        if self.speed_policy != "time":
            return
        if not strategy.steps_can_differ:
            raise ConfigError(f"speed-policy time needs a strategy that exchanges only at its syncs "
                              f"(diloco, fedavg, muloco, quorum; no ddp-warmup-steps), not {strategy.name}; "
                              "use --speed-policy fixed")
        speeds, H = Speeds.of(self), strategy.sync_every
        if speeds and min(steps := speeds.steps_taken(H)) == 0:
            slow = steps.index(0)
            raise ConfigError(f"worker {slow} (speed {speeds.speeds[slow]:g}) takes no step in a round of "
                              f"H = {H} ticks; raise --sync-every or its speed")

    def check_values(self):
        """Ranges of the config's own values (the strategy checks its options)."""
        def need(ok, msg):
            if not ok:
                raise ConfigError(msg)
        need(self.workers >= 1, f"workers must be >= 1 (got {self.workers}); pass --workers 1 or more")
        need(self.steps >= 1, f"steps must be >= 1 (got {self.steps})")
        need(self.batch_size >= 1, f"batch-size must be >= 1 (got {self.batch_size})")
        need(self.seq_len == 0 or self.seq_len >= 2, f"seq-len must be >= 2, or 0 for the model's context (got {self.seq_len})")
        need(self.lr > 0, f"lr must be > 0 (got {self.lr})")
        need(0 <= self.final_lr <= 1, f"final-lr must be a fraction of lr in [0, 1] (got {self.final_lr})")
        need(self.warmup >= -1, f"warmup must be >= 0 steps, or -1 for a fifth of the run (got {self.warmup})")
        need(self.weight_decay >= 0, f"weight-decay must be >= 0 (got {self.weight_decay})")
        for name in ("beta1", "beta2"):
            need(0 <= getattr(self, name) < 1, f"{name} must be in [0, 1) (got {getattr(self, name)})")
        need(self.grad_clip >= 0, f"grad-clip must be >= 0, 0 disables it (got {self.grad_clip})")
        need(self.eval_every >= 0, f"eval-every must be >= 0 steps, 0 for every outer step (got {self.eval_every})")
        need(self.eval_sequences >= 1, f"eval-sequences must be >= 1 held-out examples (got {self.eval_sequences})")
        for key in ("precision", "moments_precision"):
            need(getattr(self, key) in PRECISIONS,
                 f"{key.replace('_', '-')} must be one of {', '.join(PRECISIONS)} (got '{getattr(self, key)}')")
        Speeds.of(self)  # the worker speeds and their policy
        Schedule.of(self)  # the membership schedule
        parse_link(self.link)  # a preset or 'BW[/LATENCY]'
        need(self.step_time >= 0, f"step-time must be >= 0 seconds, 0 to measure it (got {self.step_time})")
        need(self.memory_limit >= 0, f"memory-limit must be >= 0 GB, 0 for MLX's default (got {self.memory_limit})")
        need(self.fine_tune_type in FINE_TUNE_TYPES, f"fine-tune-type must be one of {', '.join(FINE_TUNE_TYPES)} "
                                                      f"(got '{self.fine_tune_type}')")
        need(self.num_layers == -1 or self.num_layers >= 1, f"num-layers must be >= 1, or -1 for all (got {self.num_layers})")
        need(self.lora_rank >= 1, f"lora-rank must be >= 1 (got {self.lora_rank})")
        need(self.lora_scale > 0, f"lora-scale must be > 0 (got {self.lora_scale})")
        need(0 <= self.lora_dropout < 1, f"lora-dropout must be in [0, 1) (got {self.lora_dropout})")
        for name in self.reporters():
            need(name in REPORTERS, f"report-to: no logger '{name}'; choose from {', '.join(REPORTERS)}")
        need(not self.loss or ":" in self.loss, f"loss '{self.loss}' must name a function as 'package.module:function'")
        self.check_objective(need)

    def check_objective(self, need):
        """The post-training options' values (objectives/ checks what needs the data or the reward file)."""
        need(self.objective in OBJECTIVES, f"objective must be one of {', '.join(OBJECTIVES)} (got '{self.objective}')")
        takes_a_loss = self.objective not in OBJECTIVES or OBJECTIVES[self.objective].takes_a_loss
        need(not self.loss or takes_a_loss, f"loss is the sft objective's; objective {self.objective} has its own: "
                                            "drop --loss")
        need(self.beta >= 0 or self.beta == -1, f"beta must be >= 0, or -1 for the objective's default (got {self.beta})")
        need(self.rpo_alpha >= 0 and math.isfinite(self.rpo_alpha), f"rpo-alpha must be a finite number >= 0 (got {self.rpo_alpha})")
        need(self.group_size >= 2, f"group-size must be >= 2: GRPO's advantages compare a prompt's completions "
                                   f"(got {self.group_size})")
        need(self.max_completion_length >= 1, f"max-completion-length must be >= 1 (got {self.max_completion_length})")
        need(self.temperature > 0, f"temperature must be > 0: GRPO samples its completions (got {self.temperature})")
        need(0 < self.top_p <= 1, f"top-p must be in (0, 1], 1 for off (got {self.top_p})")
        need(self.epsilon >= 0 and self.epsilon_high >= 0, "epsilon and epsilon-high must be >= 0")
        need(self.grpo_loss_type in GRPO_LOSS_TYPES, f"grpo-loss-type must be one of {', '.join(GRPO_LOSS_TYPES)} "
                                                     f"(got '{self.grpo_loss_type}')")
        need(self.scale_rewards in ("",) + SCALE_REWARDS, f"scale-rewards must be one of {', '.join(SCALE_REWARDS)} "
                                                          f"(got '{self.scale_rewards}')")
        names, weights = self.reward_names(), self.reward_weight_values()
        for name in names:
            need(name in BUILT_IN_REWARDS or self.reward_file,
                 f"reward function '{name}' is not a built-in ({', '.join(BUILT_IN_REWARDS)}); name one, or pass "
                 "--reward-file with it")
        need(not weights or not names or len(weights) == len(names),
             f"reward-weights gives {len(weights)} weights for {len(names)} reward functions; give one per function")
        need("format" not in names or self.reward_format,
             "the format reward needs its pattern: pass --reward-format REGEX (e.g. '<answer>.*</answer>')")
        try:
            re.compile(self.reward_format)
        except re.error as e:
            raise ConfigError(f"reward-format '{self.reward_format}' is not a regular expression ({e}); "
                              "write one Python's re reads, e.g. '<answer>.*</answer>'") from None

