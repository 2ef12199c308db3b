"""The strategy zoo: each strategy one file, all written once against the communication
interface (exchange/comm.py), so each runs in the simulator and on a real cluster. `base.py` says what a
strategy implements; docs/strategies.md's "Writing a strategy" shows a new one in a page."""

from ..options import ConfigError
from .base import Strategy, option
from .ddp import DDP
from .demo import DeMo
from .diloco import DiLoCo, FedAvg
from .muloco import MuLoCo
from .sparta import SPARTA
from .sparta_diloco import SPARTADiLoCo

STRATEGIES = {cls.name: cls for cls in (DiLoCo, DDP, FedAvg, SPARTA, DeMo, MuLoCo, SPARTADiLoCo)}


def strategy_class(name: str):
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{name}'; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def make_strategy(name: str, options: dict) -> Strategy:
    return strategy_class(name)(**options)


__all__ = ["STRATEGIES", "Strategy", "option", "make_strategy", "strategy_class",
           "DDP", "FedAvg", "DiLoCo", "SPARTA", "DeMo", "MuLoCo", "SPARTADiLoCo"]
