"""Options as users write them (config files, flags, strategy and model options): how one is
declared (`option`), the one error type, typed values, and the did-you-mean hint. A leaf: it
imports nothing of the package, so every layer can use it (config.py re-exports ConfigError,
where most callers import it from)."""

import argparse
import copy
import difflib
import json
import math
from dataclasses import field, fields
from functools import partial


def option(default, help: str, choices: tuple = None, flag: bool = True, **kwargs):
    """A config key or strategy option: a dataclass field with its default and its help, the one
    line that `--help` shows; the flags, the API's arguments and `plan` are derived from it.
    `choices`: the values it takes; `flag`: False for a setting no command line sets."""
    metadata = {"help": help, "choices": choices, "flag": flag}
    if isinstance(default, (dict, list)):  # mutable: every instance gets its own copy
        return field(default_factory=partial(copy.deepcopy, default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


class ConfigError(ValueError):
    """Bad user input; the CLI prints it as one line and exits non-zero."""


AUTO = "auto"


class NumberOrAuto:
    """The field type of an option that takes a number or 'auto', a value the run works out from
    its other settings (a strategy's outer-lr: strategies/outer_lr.py)."""
    number, kind = float, "a number"

    @classmethod
    def parse(cls, text: str):
        """A flag's value: 'auto', or the number it reads as (argparse says the error otherwise)."""
        try:
            return AUTO if text == AUTO else cls.number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is neither {cls.kind} nor {AUTO}") from None


class WholeOrAuto(NumberOrAuto):
    """An option of a whole number or 'auto' (a strategy's sync-every: sync_period.py)."""
    number, kind = int, "a whole number"


def did_you_mean(key: str, names, valid: str = "valid") -> str:
    """The hint after an unknown `key`: the closest of `names`, else all of them ('{valid}: a, b')."""
    close = difflib.get_close_matches(key, list(names), n=1)
    return f"did you mean '{close[0]}'?" if close else f"{valid}: {', '.join(names) or 'none'}"


def shown(value, width: int = 60) -> str:
    """`value` as a line shows it: its repr, cut to `width` characters."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def read_json(path, what: str, fix: str):
    """The JSON in file `path`, or one ConfigError line: `path` is not `what` (not text, or not
    JSON, and where), and `fix`, what to pass instead."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not {what}: it is not text; {fix}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not {what}: not valid JSON ({e.msg} at line {e.lineno}); {fix}") from None


def checked_value(name: str, value, kind, default=None):
    """`value` as field type `kind` (bool, int, float or str), or a ConfigError naming the key and
    a valid value (`value` written as `kind`, else `default`). An int is a float too; nothing else
    is converted ("4" is not 4, 20.5 is not an int)."""
    flag = name.replace("_", "-")
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          NumberOrAuto: lambda v: v == AUTO or (isinstance(v, (int, float)) and not isinstance(v, bool)),
          WholeOrAuto: lambda v: v == AUTO or (isinstance(v, int) and not isinstance(v, bool)),
          str: lambda v: isinstance(v, str)}.get(kind)
    if ok is None:  # a field of another type (a list, a dict): the dataclass checks it
        return value
    if not ok(value):
        example = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
                   NumberOrAuto: f"a number or \"{AUTO}\"", WholeOrAuto: f"a whole number or \"{AUTO}\""}[kind]
        raise ConfigError(f"{flag} must be {example}, not {json.dumps(value)}; "
                          f"write e.g. \"{name}\": {json.dumps(valid_example(value, kind, default))}")
    if kind in (float, NumberOrAuto) and value != AUTO:
        if not math.isfinite(value):  # no setting means anything at inf or NaN (an outer-lr of inf diverged)
            raise ConfigError(f"{flag} must be a finite number, not {value}; write e.g. \"{name}\": "
                              f"{json.dumps(default if default is not None else 1.0)}")
        return float(value)
    return value


def valid_example(value, kind, default):
    """What a wrong-typed `value` should have been: itself as `kind` where it reads as one
    ("4" -> 4, "true" -> true, 4.0 -> 4), else `default` (a key's default is always valid)."""
    text = str(value).strip().lower()
    try:
        if kind is bool and text in ("true", "false"):
            return text == "true"
        if kind in (int, WholeOrAuto) and not isinstance(value, bool) and float(text) == int(float(text)):
            return int(float(text))
        if kind in (float, NumberOrAuto) and not isinstance(value, bool):
            return float(text)
    except (ValueError, OverflowError):
        pass
    if kind in (NumberOrAuto, WholeOrAuto) or (isinstance(default, kind) and not (kind is int and isinstance(default, bool))):
        return default
    return {bool: True, int: 1, float: 1.0, str: "..."}[kind]


def from_dict(cls, params, what: str):
    """Build dataclass `cls` from `params`, rejecting unknown keys with a did-you-mean hint and
    values of the wrong type with a line that names the key."""
    if not isinstance(params, dict):
        raise ConfigError(f"{what}s must be a JSON object ({{\"key\": value, ...}}), "
                          f"not a {type(params).__name__}")
    types = {f.name: f.type for f in fields(cls)}
    for key in params:
        if key not in types:
            raise ConfigError(f"unknown {what} '{key}'; {did_you_mean(key, list(types))}")
    defaults = {f.name: f.default for f in fields(cls)}
    return cls(**{k: checked_value(k, v, types[k], defaults[k]) for k, v in params.items()})
