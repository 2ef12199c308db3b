"""What a launch may make an agent read and run on its machine.

A holder of the cluster secret starts jobs, but the machine is its owner's. A job's model, tokenizer
and data paths resolve only under folders the owner allowed (`agent --models-dir`, `--data-dir`, and
this machine's Hugging Face cache), never in the agent's state folder (where what launchers ship
lands). Every piece of Python code a job names (`named_code`: a model builder or a loss function
`package.module:function`, imported from the modules installed on the machine; a GRPO reward file,
run as it is) runs only where the agent was started with `--allow-code`, and a file of code only
where it came with the job (one of the start request's shipped files, named by its name there) or
lies under a folder the owner named with `--code-dir`. `Allowed.problem` is the one decision, taken
by the agent from the job description before any process starts, new jobs and resumed ones alike.
Each refusal is one line naming the option that would allow it. A tokenizer is data here: tokenizers
load without remote code (mlx_lm_config.py). MLX-free, as the agent.
"""

import json
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


@dataclass(frozen=True)
class Code:
    """A piece of Python code a job names: a function imported from the installed modules
    (`package.module:function`), or a file run as it is (`is_file`)."""
    key: str        # the config key that names it
    what: str       # what a refusal calls it
    name: str       # as the config gives it
    is_file: bool = False


def named_code(config: TrainConfig) -> list:
    """Every piece of Python code a job of `config` would run besides mlx-diloco's own, whether or
    not its objective calls it: what `Allowed.problem` decides on (and `launch` asks of agents)."""
    code = []
    if is_code(config.model):
        code.append(Code("model", "model", config.model))
    elif builder := preset_builder(config.model):  # a preset file of type python names its builder
        code.append(Code("model", f"model preset {config.model[:200]}'s builder", builder))
    if config.loss:
        code.append(Code("loss", "loss function", config.loss))
    if config.reward_file:
        code.append(Code("reward_file", "reward file", config.reward_file, is_file=True))
    return code


def preset_builder(model: str) -> str:
    """The builder a model preset file of type python names ('' for any other model)."""
    if name_problem("model", model) or not model.endswith(".json") or not os.path.isfile(model):
        return ""
    try:
        with open(model, encoding="utf-8") as f:
            preset = json.load(f)
    except (OSError, ValueError):
        return ""  # the worker says what is wrong with it
    builder = preset.get("builder") if isinstance(preset, dict) and preset.get("type") == "python" else ""
    return builder if isinstance(builder, str) else ""


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


def shipped_code(config: TrainConfig, shipped) -> dict:
    """{config key: shipped file name} of the files of code the job names by a shipped file's name."""
    return {code.key: code.name for code in named_code(config) if code.is_file and code.name in shipped}


def shipped_data(config: TrainConfig, shipped) -> bool:
    """Whether the job's data came with it (a shard's files, besides any file of code)."""
    return bool(set(shipped) - set(shipped_code(config, shipped).values()))


def _real(path) -> Path:
    return Path(os.path.realpath(path))  # symlinks followed: a link out of an allowed folder leaves it


@dataclass(frozen=True)
class Allowed:
    state_dir: Path           # the agent's state folder: nothing a job reads comes from it
    models: tuple = ()        # --models-dir: folders whose model folders (and tokenizers) jobs may load
    data: tuple = ()          # --data-dir: folders whose files jobs may read as data (--data-on-workers)
    code: bool = False        # --allow-code: the code a job names (named_code) runs
    code_dirs: tuple = ()     # --code-dir: folders whose files of code (reward files) jobs may run

    def problem(self, config: TrainConfig, shipped=()) -> str:
        """Why this agent will not run a job of `config` ('' if it will); `shipped`: the names of the
        files that came with the job (its data shard, and files of code it names by these names)."""
        if not is_code(config.model) and (why := self.model_problem(config.model)):
            return why  # first: a preset file is read for the builder it names only where jobs may read it
        if config.tokenizer and (why := self.path_problem("tokenizer", config.tokenizer, self.model_roots(),
                                                          "--models-dir")):
            return why
        if not shipped_data(config, shipped) and config.data not in (EMBEDDED, FASHION_MNIST) and \
                (why := self.path_problem("data", config.data, self.data, "--data-dir")):
            return why
        return self.code_problem(config, shipped)

    def code_problem(self, config: TrainConfig, shipped=()) -> str:
        """Why this agent will not run the code a job of `config` names ('' if it runs all of it)."""
        for code in named_code(config):
            shown = code.name[:200]
            if not self.code:
                if code.is_file:
                    return (f"{code.what} '{shown}' is Python code, which this agent runs only when started with "
                            "--allow-code")
                return (f"{code.what} '{shown}' names Python code (package.module:function), which this agent "
                        "imports only when started with --allow-code")
            if not code.is_file or code.name in shipped:
                continue
            if not os.path.isabs(code.name) or name_problem(code.what, code.name):
                return (f"{code.what} '{shown}' is not one of the files shipped with the job, nor a path on this "
                        "machine; ship it with the job, or name its absolute path under a --code-dir folder")
            if why := self.path_problem(code.what, code.name, self.code_dirs, "--code-dir"):
                return why
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
