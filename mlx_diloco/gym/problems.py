"""The gym's benchmark problems: fixed settings that make results comparable.

A problem names the model, data, token budget, workers, link and an eval-loss target; a strategy
(and its options) is what a researcher varies. Every problem's default variant runs in minutes on
a 2-core CPU; `large` is the same question at a size for a Mac or a GPU.

Time is modelled, not measured: `step_time` fixes the seconds of one inner step (roughly what an
M-series Mac takes for this model and batch), so a scorecard's wall-clock does not depend on the
machine that ran it. Exchanges are timed on the problem's link (exchange/network.py).
"""

from dataclasses import dataclass, field

from ..config import ConfigError, TrainConfig
from ..strategies import option_names, strategy_class, without_other_options

DEFAULT_STRATEGY = TrainConfig.strategy  # the strategy a problem's own options are for: the config's default

SIZES = ("cpu", "large")


@dataclass(frozen=True)
class Problem:
    name: str
    about: str
    config: dict            # config keys of the CPU variant
    target_loss: float      # the eval loss that counts as solved (time and tokens to reach it; None: none)
    large: dict = field(default_factory=dict)  # what the large variant changes
    task: object = None     # task(log) -> {"model": ..., "data": ...}: paths made on first use (gym/addition.py)

    def settings(self, size: str = "cpu", strategy: str = None) -> dict:
        """The config keys of variant `size`; for `strategy`, without the problem's options of other
        strategies, and for a strategy other than DiLoCo without DiLoCo's (the post-training problems'
        H, payload and outer step are their DiLoCo recipe: DDP sends fp16 every step, as it does)."""
        if size not in SIZES:
            raise ConfigError(f"size must be one of {', '.join(SIZES)} (got '{size}')")
        settings = {**self.config, **(self.large if size == "large" else {})}
        if not strategy:
            return settings
        if strategy != DEFAULT_STRATEGY:
            settings = {k: v for k, v in settings.items() if k not in option_names(strategy_class(DEFAULT_STRATEGY))}
        return without_other_options(settings, strategy)

    def prepared(self, size: str = "cpu", log=print, strategy: str = None) -> dict:
        """The settings, with the paths of the problem's task where it makes its own (once)."""
        return {**self.settings(size, strategy), **(self.task(log) if self.task else {})}

def addition(form: str):
    """The addition task's SFT start and its data in `form` (gym/addition.py), made on first use."""
    def paths(log) -> dict:
        from .addition import prepare
        folder = prepare(log=log)
        return {"model": str(folder / "sft-model"), "data": str(folder / form)}
    return paths


# What every language-model problem shares: the embedded Shakespeare and a small GPT.
_SHAKESPEARE = dict(model="small", data="shakespeare", batch_size=16, eval_sequences=256, step_time=0.05)
_LARGE_GPT = dict(model="gpt-10m", seq_len=256, steps=3000, step_time=0.25, eval_sequences=512)

# Post-training on the addition task (gym/addition.py): LoRA on its SFT start, 4 laptops on Wi-Fi.
# H = 25: at least 20x fewer bytes than DDP's every step, and four outer steps in a run of 100.
# lr 1e-4 (LoRA scale 20): with one worker at 2e-3, GRPO fell from 52.6% held-out accuracy to 1.8% in 30
# steps and DPO's eval loss rose (0.693 -> 0.706 in 40); at 1e-4 GRPO rose to 56.8% in 60 steps.
_ADDITION = dict(model="the addition task's SFT start", fine_tune_type="lora", num_layers=-1, lora_rank=8,
                 seq_len=16, workers=4, sync_every=25, eval_every=25, link="wifi", step_time=0.2, warmup=10,
                 lr=1e-4)

# GRPO that learns here (docs/post-training.md, "What learns on the addition task"; DiLoCo x4, 800 steps,
# held-out accuracy from the SFT start's 47.8%): lr 1e-4 barely moves it in 200 steps (56%), 2e-3
# collapses it to 0%, 1e-3 with Dr. GRPO's normalisation learns (DDP x4: 79.8-86.2% over three runs).
# H = 25 with fp16 sent 25x fewer bytes than DDP and reached 69.8%; H = 6 with int4 and error feedback
# 79.4-81.8% (two runs) sending 22.4x fewer (H = 5: 80.8-81.8% at 18.8x; int2: at most 79.2%), at the
# outer step it was measured with (lr 0.705, momentum 0.5).
_GRPO = dict(steps=800, eval_every=100, lr=1e-3, grpo_loss_type="dr_grpo", sync_every=6, compress="int4",
             error_feedback=True, outer_lr=0.705, outer_momentum=0.5)

PROBLEMS = {p.name: p for p in [
    Problem("shakespeare-home",
            "the small GPT on Shakespeare, 4 Macs on home internet (100 Mbit/s)",
            dict(_SHAKESPEARE, workers=4, steps=500, link="internet", eval_every=50),
            target_loss=4.6, large=_LARGE_GPT),
    Problem("fashion-thunderbolt",
            "a CNN on Fashion-MNIST, 2 Macs on Thunderbolt 4",
            dict(model="cnn", data="fashion-mnist", workers=2, steps=300, batch_size=64, lr=2e-3, warmup=20,
                 eval_every=50, eval_sequences=1024, link="tb4", step_time=0.01),
            target_loss=0.45, large=dict(steps=2000, eval_sequences=4096)),
    Problem("gpt-wifi-8",
            "the small GPT on Shakespeare, 8 laptops on Wi-Fi",
            dict(_SHAKESPEARE, workers=8, steps=250, link="wifi", eval_every=50),
            target_loss=4.9, large=dict(_LARGE_GPT, steps=1500)),
    Problem("mixed-home",
            "the small GPT on Shakespeare, 2 Macs of speeds 1 and 0.5 (an M4 mini and an M1 laptop) on home internet",
            dict(_SHAKESPEARE, workers=2, steps=500, link="internet", eval_every=50, worker_speeds="1,0.5"),
            target_loss=4.6, large=_LARGE_GPT),
    Problem("slow-mac-home",
            "the small GPT on Shakespeare, 4 Macs on home internet, one of them 4x slower (a straggler)",
            dict(_SHAKESPEARE, workers=4, steps=500, link="internet", eval_every=50, worker_speeds="1,1,1,0.25"),
            target_loss=4.6, large=_LARGE_GPT),
    Problem("addition-grpo",
            "GRPO on 2-3 digit addition from a tiny Llama's SFT start, the exact answer the reward, 4 laptops on Wi-Fi",
            dict(_ADDITION, data="addition/grpo", objective="grpo", batch_size=8, group_size=8,
                 max_completion_length=6, eval_sequences=64, **_GRPO),
            target_loss=None, task=addition("grpo")),
    Problem("addition-dpo",
            "DPO on 2-3 digit addition (the right sum chosen, a near miss rejected) from the same SFT start, "
            "4 laptops on Wi-Fi",
            dict(_ADDITION, data="addition/dpo", objective="dpo", steps=100, batch_size=16, eval_sequences=256,
                 lr=3e-4, rpo_alpha=1.0),
            target_loss=None, task=addition("dpo")),
]}


def get_problem(name: str) -> Problem:
    if name not in PROBLEMS:
        raise ConfigError(f"unknown problem '{name}'; 'mlx-diloco gym list' shows them: {', '.join(PROBLEMS)}")
    return PROBLEMS[name]
