"""Strategies built from parts (EXO Gym composes its SPARTA-DiLoCo from two communication modules
in a list): each part a strategy with its own options, e.g. a per-step exchange (SPARTA's
averaging) and a periodic outer step (DiLoCo's).

A composite is a dataclass whose options are its parts' (`takes` says which options each part
class takes, in the order the flags list them; the composite may redeclare one to change its
default or help). `build()` makes the parts from those options, in the order their hooks run:
reduce_gradients and after_step are chained through them, each part's checkpoint state sits under
its own key, and the global model is the one a part keeps (DiLoCo's), else worker 0's.
"""

from dataclasses import fields, replace

from ..options import ConfigError
from .base import NO_INPUTS, Strategy, TickInputs, option

ALL = None  # in `takes`: every option of that part


class Composite(Strategy):
    takes: dict = {}  # part class -> names of the options it takes from the composite (ALL: all its own)

    def __init_subclass__(cls, **kwargs):
        """The parts' options become the composite's fields (before @dataclass reads them)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__annotations__", {})
        annotations = {}
        for part, names in cls.takes.items():
            for f in fields(part):
                if (names is ALL or f.name in names) and f.name not in annotations:
                    annotations[f.name] = own.get(f.name, f.type)
                    if f.name not in own:
                        setattr(cls, f.name, option(f.default, f.metadata["help"]))
        cls.__annotations__ = {**annotations, **own}

    def build(self) -> dict:
        """{key: part}: the parts these options make, in the order their hooks run."""
        raise NotImplementedError

    def part(self, cls) -> Strategy:
        """A part of class `cls`, with the options it takes from this composite."""
        names = self.takes[cls]
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls) if names is ALL or f.name in names})

    def check(self):
        try:
            self.parts = self.build()  # each part checks its own options
        except ConfigError as e:  # the line names the strategy the user chose, not the part
            message = str(e)
            part = next((c.name for c in self.takes if message.startswith(f"{c.name}: ")), None)
            raise ConfigError(f"{self.name}: {message[len(part) + 2:]}" if part else message) from None

    def __getattr__(self, key):
        """A part by its key: `strategy.sparta`, `strategy.diloco`."""
        parts = self.__dict__.get("parts", {})
        if key in parts:
            return parts[key]
        raise AttributeError(f"{type(self).__name__} has no attribute or part '{key}'")

    @property
    def global_part(self):
        """(key, part) of the part that keeps a global model, or None."""
        return next(((k, p) for k, p in self.parts.items() if p.keeps_global_model), None)

    @property
    def steps_can_differ(self) -> bool:
        return all(p.steps_can_differ for p in self.parts.values())

    @property
    def worker_copies(self) -> int:
        return sum(p.worker_copies for p in self.parts.values())

    @property
    def syncs_every_h(self) -> bool:
        return all(p.syncs_every_h for p in self.parts.values())

    @property
    def own_state(self) -> str:
        return " and ".join(p.own_state for p in self.parts.values() if p.own_state)

    @property
    def outer_copies(self) -> int:
        return sum(p.outer_copies for p in self.parts.values())

    @property
    def keeps_global_model(self) -> bool:
        return self.global_part is not None

    @property
    def sync_pieces(self) -> int:
        return max(p.sync_pieces for p in self.parts.values())

    @property
    def offloads_outer(self) -> bool:
        return any(p.offloads_outer for p in self.parts.values())

    def memory_savings(self, blocks: int) -> list:
        return [change for p in self.parts.values() for change in p.memory_savings(blocks)]

    @property
    def leading_part(self) -> Strategy:
        """The part that keeps the global model, else the first: it sets the sync points and the label."""
        return self.global_part[1] if self.global_part else next(iter(self.parts.values()))

    @property
    def schedule(self):
        return self.leading_part.schedule

    def label_options(self) -> list:
        return self.leading_part.label_options()

    # ---- the run: every hook goes through the parts in order
    def bind(self, comm, steps):
        for p in self.parts.values():
            p.bind(comm, steps)
        return super().bind(comm, steps)

    def check_model(self, spec, adapted_blocks=None):
        for p in self.parts.values():
            p.check_model(spec, adapted_blocks)

    def setup(self, params):
        for p in self.parts.values():
            p.setup(params)

    def reduce_gradients(self, grads, step):
        for p in self.parts.values():
            grads = p.reduce_gradients(grads, step)
        return grads

    def after_step(self, params, step, tick: TickInputs = NO_INPUTS):
        for p in self.parts.values():
            params = p.after_step(params, step, tick)
        return params

    def global_params(self, params):
        return self.global_part[1].global_params(params) if self.global_part else super().global_params(params)

    def global_from_state(self, template, saved):
        if not self.global_part:
            return super().global_from_state(template, saved)
        key, part = self.global_part
        return part.global_from_state(template, replace(saved, strategy=saved.strategy[key]))  # its part's state

    def state(self):
        return {key: p.state() for key, p in self.parts.items()}

    def load_state(self, state):
        for key, p in self.parts.items():  # a part that keeps no arrays (SPARTA) has none in a checkpoint
            p.load_state(state.get(key, {}))
