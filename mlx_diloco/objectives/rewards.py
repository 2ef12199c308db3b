"""GRPO's reward functions: the built-ins and a user's Python file (--reward-file rewards.py).

A reward function scores a batch of completions, as mlx-lm-lora and TRL call theirs:

    def f(prompts, completions, answer, **kwargs) -> list[float | None]

`prompts`: each completion's prompt as the data gives it (a string or messages); `completions`: the
sampled texts (without the EOS); `answer`: each one's answer from the data; keyword arguments
`completion_ids` (the sampled token ids) and `types` (None) are given to a function that takes them
(or **kwargs). None means the function does not score that completion (TRL); a completion none of
them scores gets no advantage. The reward is the weighted sum over the functions (--reward-weights).

Built-ins: `exact_answer` 1 when the completion, stripped, is the answer; `number_match` 1 when its
last number equals the answer's; `format` 1 when it matches --reward-format whole (re.fullmatch);
`length` DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment): 0 up to 3/4 of
max-completion-length tokens, then falling linearly to -1 at it.

A file that cannot be loaded, and a function that raises or returns NaN or inf mid-run, are each one line
naming the file or the function and the line or the prompt (a RewardError stops the run; the run
keeps its last checkpoint). MLX-free.
"""

import importlib.util
import inspect
import math
import re
import sys
import traceback
from pathlib import Path

import numpy as np

from ..options import ConfigError, did_you_mean, shown

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SIGNATURE = "f(prompts, completions, answer, **kwargs) -> list of floats"


class RewardError(ConfigError):
    """A reward function failed mid-run (raised, or returned NaN, inf or something else than numbers)."""


def exact_answer(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]


def number_match(prompts, completions, answer, **kwargs):
    def last_number(text):
        numbers = NUMBER.findall(text)
        return float(numbers[-1]) if numbers else None
    return [float(last_number(c) is not None and last_number(c) == last_number(a)) for c, a in zip(completions, answer)]


def format_reward(pattern: str):
    regex = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, answer, **kwargs):
        return [float(regex.fullmatch(c.strip()) is not None) for c in completions]
    return format


def length_reward(max_tokens: int):
    cache = max(1, max_tokens // 4)  # the last quarter of the budget is punished, more the closer to it

    def length(prompts, completions, answer, completion_ids, **kwargs):
        return [min(0.0, (max_tokens - cache - len(ids)) / cache) for ids in completion_ids]
    return length


# config.BUILT_IN_REWARDS names them (config.py imports nothing above it); each made from the config
BUILT_IN = {"exact_answer": lambda config: exact_answer, "number_match": lambda config: number_match,
            "format": lambda config: format_reward(config.reward_format),
            "length": lambda config: length_reward(config.max_completion_length)}


def load_reward_file(path) -> dict:
    """{name: function} of the public functions a Python file defines, in its order; one ConfigError
    line for a file that is missing, does not load (the line that failed), or defines none."""
    path = Path(path)
    if why := reward_file_problem(path):
        raise ConfigError(why)
    name = f"mlx_diloco_rewards_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import: dataclasses and pickling find it
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:  # (a NUL byte's has no line number)
        raise ConfigError(f"{path} line {e.lineno or first_nul_line(path)}: {e.msg}; the reward file must be "
                          "valid Python") from None
    except Exception as e:  # the user's code, at import: its line in the file
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                     if Path(f.filename).resolve() == path.resolve()), "?")
        raise ConfigError(f"{path} line {line}: {type(e).__name__}: {e} (while loading the reward file); fix "
                          "it, or install what it imports") from None
    functions = {n: f for n, f in vars(module).items()
                 if inspect.isfunction(f) and f.__module__ == name and not n.startswith("_")}
    if not functions:
        raise ConfigError(f"{path} defines no reward function; write one as def {SIGNATURE}")
    for fn_name, fn in functions.items():
        check_signature(path, fn_name, fn)
    return functions


def reward_file_problem(path: Path) -> str:
    """Why `path` cannot be loaded as a reward file ('' if it can): Python imports a .py file only."""
    if path.is_dir():
        return f"reward file {path} is a folder; pass a Python file (.py) of functions {SIGNATURE}"
    if not path.is_file():
        return f"reward file {path} does not exist; pass a Python file (.py) of functions {SIGNATURE}"
    if path.suffix != ".py":
        return (f"reward file {path} is not a .py file; pass a Python file of functions {SIGNATURE} (name it "
                f"{path.stem or 'rewards'}.py)")
    return ""


def first_nul_line(path: Path):
    """The line of the file's first NUL byte ('?' without one)."""
    data = path.read_bytes()
    return data.count(b"\n", 0, data.index(b"\0")) + 1 if b"\0" in data else "?"


def check_signature(path, name: str, fn):
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    missing = [k for k in ("prompts", "completions", "answer") if k not in params and not takes_any]
    if missing:
        raise ConfigError(f"{path} line {fn.__code__.co_firstlineno}: reward function '{name}' takes no "
                          f"{', '.join(missing)}; write it as {SIGNATURE} (a helper's name starts with _)")


def chosen_functions(config) -> list:
    """[(name, function)] of reward-functions (names of built-ins or the reward file's), or all of
    the reward file's, or exact_answer."""
    from_file = load_reward_file(config.reward_file) if config.reward_file else {}
    names = config.reward_names() or list(from_file) or ["exact_answer"]
    chosen = []
    for name in names:
        if name in from_file:
            chosen.append((name, from_file[name]))
        elif name in BUILT_IN:
            chosen.append((name, BUILT_IN[name](config)))
        else:
            raise ConfigError(f"no reward function '{name}' in {config.reward_file}; "
                              f"{did_you_mean(name, list(from_file), valid='it defines')}")
    return chosen


class Rewards:
    """The weighted sum of the chosen functions' rewards of a batch of completions."""

    def __init__(self, config):
        self.functions = chosen_functions(config)
        self.weights = np.array(config.reward_weight_values() or [1.0] * len(self.functions))
        if len(self.weights) != len(self.functions):
            raise ConfigError(f"reward-weights gives {len(self.weights)} weights for {len(self.functions)} reward "
                              f"functions ({', '.join(n for n, _ in self.functions)}); give one per function")
        self.source = f" in {config.reward_file}" if config.reward_file else ""

    def __call__(self, prompts: list, completions: list, answers: list, completion_ids: list) -> np.ndarray:
        """Each completion's reward (NaN where no function scores it); a RewardError line for a
        function that raises or returns anything but a number or None for each completion."""
        scores = np.full((len(completions), len(self.functions)), np.nan)
        for j, (name, fn) in enumerate(self.functions):
            args = dict(prompts=prompts, completions=completions, answer=answers, completion_ids=completion_ids,
                        types=None)
            try:
                values = call(fn, args)
            except Exception as e:  # the user's function: which prompt it fails at, in one line
                raise self.failure(name, fn, args, e) from None
            if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
                raise RewardError(f"reward '{name}'{self.source} returned {describe(values)}, not a list of "
                                  f"{len(completions)} numbers (one per completion); return one per completion")
            for i, value in enumerate(values):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                        or not math.isfinite(value):  # an inf reward would make every advantage NaN
                    raise RewardError(f"reward '{name}'{self.source} returned {value!r} for prompt "
                                      f"{shown(prompts[i])} (completion {shown(completions[i])}); return a finite "
                                      "number, or None where it does not apply")
                scores[i, j] = value
        total = np.nansum(scores * self.weights, axis=1)
        return np.where(np.isnan(scores).all(axis=1), np.nan, total)

    def failure(self, name: str, fn, args: dict, error: Exception) -> RewardError:
        """The line for a function that raised: the first completion it raises at alone, if any."""
        for i in range(len(args["completions"])):
            one = {k: v if v is None else v[i:i + 1] for k, v in args.items()}
            try:
                call(fn, one)
            except Exception as e:
                return RewardError(f"reward '{name}'{self.source} raised {type(e).__name__}: {e} at prompt "
                                   f"{shown(args['prompts'][i])} (completion {shown(args['completions'][i])})")
        return RewardError(f"reward '{name}'{self.source} raised {type(error).__name__}: {error} on a batch of "
                           f"{len(args['completions'])} completions")


def call(fn, args: dict):
    """`fn` with the keyword arguments it takes (all, for one with **kwargs: mlx-lm-lora's functions
    take no completion_ids)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        args = {k: v for k, v in args.items() if k in params}
    return fn(**args)


def describe(value) -> str:
    return f"a list of {len(value)}" if isinstance(value, (list, tuple)) else f"{type(value).__name__} {shown(value)}"
