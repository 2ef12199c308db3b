"""GRPO's reward functions (issue 38): the built-ins, a user's file loaded with one line for every error
in it, mlx-lm-lora's and TRL's signatures, and a function that raises or returns NaN named in one line
with the prompt it failed at."""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mlx_diloco.config import BUILT_IN_REWARDS, ConfigError, TrainConfig
from mlx_diloco.objectives.rewards import BUILT_IN, RewardError, Rewards, load_reward_file


def config(**keys):
    return TrainConfig.from_dict({"objective": "grpo", **keys})


def score(rewards, completions, answers, ids=None):
    return rewards(["p"] * len(completions), completions, answers, ids or [[1] * len(c) for c in completions])


def test_the_built_ins_the_config_names_are_the_ones_there_are():
    assert set(BUILT_IN) == set(BUILT_IN_REWARDS)


def test_built_in_rewards():
    c = config(reward_functions="exact_answer,number_match,format,length", reward_format=r"\d+",
               max_completion_length=8, reward_weights="1,0.5,0.25,1")
    got = score(Rewards(c), [" 46 ", "it is 46", "46!", "1234567"], ["46", "46.0", "47", "1234567"],
                ids=[[1, 2], [1] * 8, [1] * 3, [1] * 7])
    # exact, number match (46 == 46.0), format (digits only), length (0 up to 6 tokens, -1 at 8)
    np.testing.assert_allclose(got, [1 + 0.5 + 0.25, 0.5 - 1, 0, 1 + 0.5 + 0.25 - 0.5])


def test_exact_answer_is_the_default(tmp_path):
    np.testing.assert_allclose(score(Rewards(config()), ["46", "47"], ["46", "46"]), [1, 0])


def test_a_reward_file_in_mlx_lm_loras_and_trls_signatures(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text('''
import re

def r1_int(prompts, completions, answer, types=None):          # mlx-lm-lora's: no completion_ids
    return [0.5 if c.strip().isdigit() else 0.0 for c in completions]

def short(prompts, completions, completion_ids, **kwargs):     # TRL's: the columns as keyword arguments
    return [1.0 if len(ids) <= 2 else None for ids in completion_ids]

def _helper():
    pass
''')
    assert list(load_reward_file(path)) == ["r1_int", "short"]
    rewards = Rewards(config(reward_file=str(path)))
    got = score(rewards, ["12", "abc", "12345"], ["", "", ""], ids=[[1, 2], [1], [1, 2, 3]])
    np.testing.assert_allclose(got, [1.5, 1.0, 0.5])
    picked = Rewards(config(reward_file=str(path), reward_functions="short,exact_answer", reward_weights="2,1"))
    got = score(picked, ["12", "abc"], ["12", "x"], ids=[[1, 2, 3], [1]])
    np.testing.assert_allclose(got, [1.0, 2.0])  # short does not score "12" (3 tokens): exact answer alone


def test_a_completion_no_function_scores_has_no_reward(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text("def never(prompts, completions, answer, **kwargs):\n    return [None] * len(completions)\n")
    assert math.isnan(score(Rewards(config(reward_file=str(path))), ["1"], ["1"])[0])


LOAD_ERRORS = [
    ("def f(prompts, completions, answer:\n    return []\n", r"rewards.py line 1: '\(' was never closed"),
    ("import not_a_module_here\n", r"rewards.py line 1: ModuleNotFoundError: No module named 'not_a_module_here' "
                                   r"\(while loading the reward file\)"),
    ("x = 1\n\ny = 1 / 0\n", r"rewards.py line 3: ZeroDivisionError"),
    ("X = 3\n", r"rewards.py defines no reward function; write one as def f\(prompts, completions, answer"),
    ("def f(completions):\n    return []\n", r"rewards.py line 1: reward function 'f' takes no prompts, answer"),
]


@pytest.mark.parametrize("source, line", LOAD_ERRORS)
def test_a_reward_file_that_does_not_load_is_one_line(tmp_path, source, line):
    path = tmp_path / "rewards.py"
    path.write_text(source)
    with pytest.raises(ConfigError, match=line) as e:
        Rewards(config(reward_file=str(path)))
    assert "\n" not in str(e.value)


def test_a_reward_file_with_a_nul_byte_names_its_line(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_bytes(b"def f(prompts, completions, answer, **kwargs):\n    return [0.0]\x00\n")
    with pytest.raises(ConfigError) as e:
        load_reward_file(path)
    assert str(e.value) == (f"{path} line 2: source code string cannot contain null bytes; the reward file must be "
                            "valid Python")  # it said "line None"


def test_a_reward_file_that_is_not_a_py_file_is_one_line(tmp_path):
    """It was a 38-line traceback ('NoneType' object has no attribute 'loader'): Python imports .py files."""
    (tmp_path / "noext").write_text("def f(prompts, completions, answer, **kwargs):\n    return [0.0]\n")
    for path, said in ((tmp_path / "noext", "is not a .py file; pass a Python file of functions f(prompts, "
                                            "completions, answer, **kwargs) -> list of floats (name it noext.py)"),
                       (Path("/etc/passwd"), "is not a .py file"),
                       (tmp_path, "is a folder; pass a Python file (.py)")):
        with pytest.raises(ConfigError) as e:
            Rewards(config(reward_file=str(path)))
        assert str(e.value).startswith(f"reward file {path} {said}") and "\n" not in str(e.value)


@pytest.mark.parametrize("weights", ["inf", "1,nan", "-inf,1"])
def test_reward_weights_must_be_finite(weights):
    """A NaN weight zeroed every reward silently (nansum), an inf one made them NaN."""
    with pytest.raises(ConfigError, match=f"^reward-weights must be finite numbers, comma-separated \\(e.g. 1,0.5\\), "
                                          f"not '{weights}'$"):
        config(reward_functions="exact_answer,number_match"[:None if "," in weights else 12], reward_weights=weights)


def test_reward_names_and_weights_are_checked(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text("def correct(prompts, completions, answer, **kwargs):\n    return [1.0] * len(completions)\n")
    with pytest.raises(ConfigError, match="no reward function 'corect' in .*; did you mean 'correct'"):
        Rewards(config(reward_file=str(path), reward_functions="corect"))
    with pytest.raises(ConfigError, match="reward function 'corect' is not a built-in"):
        config(reward_functions="corect")
    with pytest.raises(ConfigError, match="reward-weights gives 2 weights for 1 reward functions"):
        Rewards(config(reward_file=str(path), reward_weights="1,2"))
    with pytest.raises(ConfigError, match="the format reward needs its pattern"):
        config(reward_functions="format")
    with pytest.raises(ConfigError, match="reward-file .* does not exist|reward file .* does not exist"):
        Rewards(config(reward_file=str(tmp_path / "missing.py")))


def test_a_function_that_raises_is_named_with_the_prompt_it_fails_at(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text("def picky(prompts, completions, answer, **kwargs):\n"
                    "    return [1.0 / (c != 'zero') for c in completions]\n")
    rewards = Rewards(config(reward_file=str(path)))
    with pytest.raises(RewardError) as e:
        rewards(["1+1=", "0+0="], ["2", "zero"], ["2", "0"], [[1], [1]])
    assert str(e.value) == (f"reward 'picky' in {path} raised ZeroDivisionError: float division by zero at prompt "
                            "'0+0=' (completion 'zero')")


@pytest.mark.parametrize("returned, said", [("[float('nan')] * len(completions)", "returned nan for prompt '1\\+1='"),
                                            ("[float('inf')] * len(completions)", "returned inf for prompt '1\\+1=' .*; "
                                                                                  "return a finite number"),
                                            ("[-float('inf')] * len(completions)", "returned -inf for prompt"),
                                            ("[1.0]", "returned a list of 1, not a list of 2 numbers"),
                                            ("['1'] * len(completions)", "returned '1' for prompt")])
def test_a_function_that_returns_nan_inf_or_not_numbers_is_one_line(tmp_path, returned, said):
    path = tmp_path / "rewards.py"
    path.write_text(f"def bad(prompts, completions, answer, **kwargs):\n    return {returned}\n")
    with pytest.raises(RewardError, match=said):
        Rewards(config(reward_file=str(path)))(["1+1=", "2+2="], ["2", "4"], ["2", "4"], [[1], [1]])


def test_reward_options_in_mlx_lm_loras_yaml(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("train_mode: grpo\nreward_functions: [exact_answer, number_match]\nreward_weights: [1.0, 0.5]\n"
                    "group_size: 8\nbeta: 0.04\nreward_functions_file: null\nmax_completion_length: 16\n")
    c = TrainConfig.from_file(path)
    assert (c.objective, c.reward_functions, c.reward_weights, c.group_size, c.beta, c.max_completion_length) == \
        ("grpo", "exact_answer,number_match", "1.0,0.5", 8, 0.04, 16)
    assert replace(c, beta=-1).objective_beta() == 0.0 and replace(c, objective="dpo", beta=-1).objective_beta() == 0.1
    path.write_text("train_mode: dpo\ndpo_cpo_loss_type: ipo\n")
    with pytest.raises(ConfigError, match="dpo_cpo_loss_type: 'ipo': DPO's loss here is the sigmoid one"):
        TrainConfig.from_file(path)
