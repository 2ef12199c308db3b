"""What a launch may make an agent read and run on its machine.

A holder of the cluster secret starts jobs, but the machine is its owner's. A job's model, tokenizer
and data paths resolve only under folders the owner allowed (`agent --models-dir`, `--data-dir`, and
this machine's Hugging Face cache), never in the agent's state folder (where what launchers ship
lands); and a model or loss function named as `package.module:function` (Python code, imported
from the modules installed on the machine) only when the agent runs with `--allow-code`. Each
refusal is one line naming the option that would allow it. MLX-free, as the agent.
"""

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .. import hub
from ..config import TrainConfig
from ..data import EMBEDDED, FASHION_MNIST

MAX_NAME = 4096  # characters of a model, tokenizer or data name: a path is at most PATH_MAX


def is_code(name: str) -> bool:
    """Whether a model or loss names Python code, `package.module:function` (not a path: no '/')."""
    return ":" in name and "/" not in name


def is_preset(name: str) -> bool:
    return not name_problem("model", name) and "/" not in name and \
        (resources.files("mlx_diloco.presets") / f"{name}.json").is_file()


def hf_cache() -> Path:
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def name_problem(what: str, name: str) -> str:
    """Why `name` cannot name a file ('' if it can): too long, or holding a NUL byte."""
    if len(name) > MAX_NAME or "\0" in name:
        return f"{what} name of {len(name)} characters{' with a NUL byte' if chr(0) in name else ''}: not a path"
    return ""


def _real(path) -> Path:
    return Path(os.path.realpath(path))  # symlinks followed: a link out of an allowed folder leaves it


@dataclass(frozen=True)
class Allowed:
    state_dir: Path           # the agent's state folder: nothing a job reads comes from it
    models: tuple = ()        # --models-dir: folders whose model folders (and tokenizers) jobs may load
    data: tuple = ()          # --data-dir: folders whose files jobs may read as data (--data-on-workers)
    code: bool = False        # --allow-code: builders and loss functions named as package.module:function

    def problem(self, config: TrainConfig, shipped: bool) -> str:
        """Why this agent will not run a job of `config` ('' if it will); `shipped`: its data came as blobs."""
        for what, name in (("model", config.model), ("loss function", config.loss)):
            if name and is_code(name) and not self.code:
                return (f"{what} '{name[:200]}' names Python code (package.module:function), which this agent "
                        "imports only when started with --allow-code")
        if not is_code(config.model) and (why := self.model_problem(config.model)):
            return why
        if config.tokenizer and (why := self.path_problem("tokenizer", config.tokenizer, self.model_roots(),
                                                          "--models-dir")):
            return why
        if not shipped and config.data not in (EMBEDDED, FASHION_MNIST):
            return self.path_problem("data", config.data, self.data, "--data-dir")
        return ""

    def model_roots(self) -> tuple:
        return (*self.models, hf_cache())

    def model_problem(self, model: str) -> str:
        """'' for a preset, a hub name (ORG/NAME: this machine's Hugging Face cache) or a path under the
        model roots."""
        if why := name_problem("model", model):
            return why
        if is_preset(model) or hub.is_hub_name(model):
            return ""
        return self.path_problem("model", model, self.model_roots(), "--models-dir")

    def path_problem(self, what: str, path: str, roots: tuple, option: str) -> str:
        """'' if `path` is absolute and, its links followed, inside one of `roots` and not in the state folder."""
        shown = path[:200]
        if why := name_problem(what, path):
            return why
        if not os.path.isabs(path):
            return f"{what} '{shown}' must be an absolute path on this machine (the launcher makes its paths absolute)"
        real = _real(path)
        if real.is_relative_to(_real(self.state_dir)):
            return f"{what} '{shown}' is in this agent's state folder, which holds what launchers send; name it elsewhere"
        if not any(real.is_relative_to(_real(root)) for root in roots):
            folders = ", ".join(str(r) for r in roots) or "none"
            return (f"{what} '{shown}' is outside the folders this agent's jobs may read it from ({folders}); start "
                    f"the agent with {option} naming a folder that holds it")
        return ""

    def model_folder(self, model: str):
        """The folder of `model` on this machine if a job may load it (has_model), else None (a preset
        and a builder name no folder)."""
        if is_code(model) or is_preset(model) or self.model_problem(model):
            return None
        return hub.local_folder(model)
