"""A run's sync period against its link (sync_period.py's rule, with this run's numbers): what one
sync's exchange costs on the config's link at its step time, `--sync-every auto` resolved, and the
start line that says H, the exchanges' share of the wall-clock and the outer steps it leaves.

The step time: --step-time where given (sim's time model, the gym's problems), else the model's
FLOPs per step at sync_period.ASSUMED_MFU of this machine's measured matmul peak (the line says so).
"""

from ..exchange.codecs import get_codec
from ..exchange.comm import exchange_plan
from ..exchange.network import exchange_time, parse_link
from ..machine.memory import trained_shape
from ..options import AUTO, ConfigError
from ..strategies.outer_lr import few_outer_steps
from ..schedules.sync_period import ASSUMED_MFU, SyncCost, choose_sync_every, period_line
from ..machine.utilisation import flops_per_token, peak_gflops


def has_period(strategy) -> bool:
    """A strategy whose workers meet every H steps with an exchange of the model (DiLoCo's kind)."""
    H = getattr(strategy, "sync_every", None)
    return (H == AUTO or (isinstance(H, int) and H > 0)) and hasattr(strategy, "compress") and hasattr(strategy, "fragments")


def sync_cost(config, strategy, values: int = None) -> tuple:
    """(SyncCost, where its step time comes from) of `config` trained with `strategy`; `values`: what
    trains (counted from the config's model where not given)."""
    if values is None:
        spec, shape = trained_shape(config)
        values = shape.trainable if shape.trainable is not None else shape.parameters
    P = strategy.fragments
    _, hops, _, sent = exchange_plan(get_codec(strategy.compress), values // P, config.workers)
    exchange_s = exchange_time(hops, sent, parse_link(config.link))
    if config.step_time:
        step_s, source = config.step_time, "--step-time"
    else:
        seq_len = config.seq_len or spec.context_length
        flops = (flops_per_token(shape, seq_len) or 6 * values) * config.batch_size * seq_len
        peak = peak_gflops()
        step_s = flops / (ASSUMED_MFU * peak * 1e9)
        source = f"estimated: its FLOPs at {ASSUMED_MFU:.0%} of this machine's {peak:,.0f} GFLOP/s; --step-time sets it"
    return SyncCost(exchange_s, step_s, P, strategy.overlap_steps), source


def with_period(config, strategy, values: int = None) -> tuple:
    """(strategy, notes): `strategy` with sync-every auto resolved (a new one), and the start lines
    about its period (none for one worker, or a strategy without a period)."""
    if not has_period(strategy) or config.workers < 2:
        return strategy, []
    if values is not None and not config.step_time and strategy.sync_every == AUTO:
        raise ConfigError("sync-every auto needs the seconds an inner step takes where the workers will train: "
                          "give the Trainer step_time=..., or a number of steps for sync_every")
    cost, source = sync_cost(config, strategy, values)
    within_budget = choose_sync_every(cost, minimum=strategy.overlap_steps + 1)  # the smallest H within budget
    chosen = strategy.sync_every == AUTO
    if chosen:
        strategy = type(strategy)(**{**strategy.options(), "sync_every": within_budget})
    H = strategy.sync_every
    notes = [period_line(H, config.steps, cost, parse_link(config.link).describe(), source, chosen)]
    if note := few_outer_steps(config.workers, H, config.steps, within_budget):
        notes.append(note)
    return strategy, notes
