"""The objectives a run can optimize (config `objective`), by name: the one registry of them. MLX-free,
so that the config checks a name, and the data, the launcher and the plots ask what an objective
trains on, without loading one; each names the class that implements it (objectives/MODULE.py),
which `objectives.objective_class` imports when a run makes it. A new objective is its file and
its line here."""

from dataclasses import dataclass

from ..options import ConfigError


@dataclass(frozen=True)
class Kind:
    name: str
    module: str      # objectives/MODULE.py holds its class
    cls: str         # the class's name there
    data: str        # what it trains on: "text" (the data's next tokens), "pairs" (preferences), "prompts"
    reference: bool = False   # it keeps the starting policy to compare with (a frozen copy of what trains)

    @property
    def post_training(self) -> bool:
        """It trains on post-training data (pairs or prompts, data/post_training.py), not on text."""
        return self.data != "text"

    def rows_per_example(self, config) -> int:
        """Sequences a step trains per example of its batch: a pair's two, a prompt's group, one text."""
        return {"pairs": 2, "prompts": config.group_size}.get(self.data, 1)

    @property
    def takes_a_loss(self) -> bool:
        """A user's loss (config `loss`) may replace its own: the next-token loss only."""
        return self.data == "text"


OBJECTIVES = {k.name: k for k in (
    Kind("sft", "base", "Objective", "text"),
    Kind("dpo", "dpo", "DPO", "pairs", reference=True),
    Kind("orpo", "orpo", "ORPO", "pairs"),
    Kind("grpo", "grpo", "GRPO", "prompts", reference=True),  # its KL term, and the KL it reports
)}
DEFAULT = "sft"


def kind(name: str) -> Kind:
    """The objective named `name`, or one line naming those there are."""
    if name not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)} (got '{name}')")
    return OBJECTIVES[name]
