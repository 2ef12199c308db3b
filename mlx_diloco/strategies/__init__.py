"""The strategy zoo: each strategy one file, all written once against the communication
interface (exchange/comm.py), so each runs in the simulator and on a real cluster. `base.py` says what a
strategy implements; docs/strategies.md's "Writing a strategy" shows a new one in a page. A new
strategy is its file and its line in STRATEGIES."""

from dataclasses import fields

from ..config import TrainConfig
from ..options import ConfigError, did_you_mean
from .base import Strategy, option
from .composite import Composite
from .ddp import DDP
from .demo import DeMo
from .desloc import DESLOC
from .diloco import DiLoCo, FedAvg
from .muloco import MuLoCo
from .noloco import NoLoCo
from .quorum import Quorum
from .sparta import SPARTA
from .sparseloco import SparseLoCo
from .sparta_diloco import SPARTADiLoCo

STRATEGIES = {cls.name: cls for cls in (DiLoCo, DDP, FedAvg, SPARTA, DeMo, MuLoCo, SPARTADiLoCo,
                                        SparseLoCo, DESLOC, Quorum, NoLoCo)}


def strategy_class(name: str):
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}'; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def make_strategy(name: str, options: dict) -> Strategy:
    """Strategy `name` with `options` (the keys of a flat config that are not the config's own):
    an option of another strategy, or a key of neither, is one line naming it."""
    cls = strategy_class(name)
    theirs = option_names(cls)
    for key in options:
        if key not in theirs:
            others = [n for n, c in STRATEGIES.items() if key in option_names(c)]
            if others:
                raise ConfigError(f"'{key}' is an option of {', '.join(others)}, not of strategy {name}")
            own = {f.name for f in fields(TrainConfig)}
            raise ConfigError(f"unknown config key '{key}'; {did_you_mean(key, sorted(own | theirs))}")
    return cls(**options)


def option_names(cls) -> set:
    return {f.name for f in fields(cls)}


def without_other_options(settings: dict, strategy: str) -> dict:
    """`settings` without the options of strategies other than `strategy` (a problem's H, for DDP;
    a sweep over strategies: each point keeps its own strategy's)."""
    others = {name for cls in STRATEGIES.values() for name in option_names(cls)} - option_names(strategy_class(strategy))
    return {k: v for k, v in settings.items() if k not in others}


__all__ = ["STRATEGIES", "Strategy", "Composite", "option", "make_strategy", "strategy_class", "without_other_options",
           "DDP", "FedAvg", "DiLoCo", "SPARTA", "DeMo", "MuLoCo", "SPARTADiLoCo",
           "SparseLoCo", "DESLOC", "Quorum", "NoLoCo"]
