"""GRPO's rewards (objectives/rewards.py): the built-ins on hand-written cases, weights, a user's FILE.py:FUNCTION,
and one-line errors for rewards that cannot be loaded or that fail."""

from __future__ import annotations

import pytest

from llamatron.errors import ConfigError
from llamatron.objectives.rewards import RewardError, final_answer, load_rewards, same_answer, score


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so the total is 42.", "42", True),
        ("3 + 4 = 7, then 7 * 6 = 42", "42", True),  # the last number counts
        ("42 apples, minus 2: 40", "42", False),
        ("the answer is \\boxed{1,000}", "1000", True),  # thousands separators
        ("\\boxed{1000.0} and then 7", "1000", True),  # a \boxed{} answer wins over a later number
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),  # nested braces kept, compared as text
        ("x = 0.5", "1/2", True),  # fractions compared as numbers
        ("so 0.5", "\\frac{1}{2}", True),  # LaTeX fractions too
        ("it is -3", "-3", True),
        ("it costs $18.", "18", True),
        ("no number here", "5", False),
        ("Natalia sold 48/2 = 24 clips in May. 48+24 = 72 #### 72", "Natalia ... #### 72", True),  # GSM8K answers
        ("\\boxed{Paris}", "paris", False),  # text answers compared exactly (but for spaces and a final period)
        ("\\boxed{Paris }", "Paris.", True),
    ],
)
def test_exact_answer(completion: str, answer: str, expected: bool):
    assert same_answer(completion, answer) is expected


def test_final_answer():
    assert final_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert final_answer("1, 2 and 3.5") == "3.5"
    assert final_answer("none") is None


def _score(specs, weights=(), records=None, completions=("<think>a</think><answer>4</answer>", "4", "five")):
    rewards = load_rewards(list(specs), list(weights), max_completion_length=10)
    records = records or [{"prompt": "2+2?", "answer": "4"}] * len(completions)
    ids = [[1] * (i + 1) for i in range(len(completions))]
    return score(rewards, ["2+2?"] * len(completions), completions, ids, records, [1, 1, 2][: len(completions)])


def test_builtins():
    exact, fmt, length, regex = _score(["exact_answer", "format", "length", "regex:^\\d+$"])
    assert exact == [1.0, 1.0, 0.0]
    assert fmt == [1.0, 0.0, 0.0]
    assert length == [-0.1, -0.2, -0.3]
    assert regex == [0.0, 1.0, 0.0]


def test_user_function_gets_trl_arguments(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def reward(prompts, completions, completion_ids, answer, level, **kwargs):\n"
        "    return [len(c) + (lvl == 'hard') for c, lvl in zip(completions, level)]\n"
    )
    records = [{"prompt": "p", "answer": "4", "level": "hard"}, {"prompt": "p", "answer": "4", "level": "easy"}]
    (values,) = _score([f"{f}:reward"], records=records, completions=("ab", "abc"))
    assert values == [3.0, 3.0]


def test_data_fields_are_never_code(tmp_path):
    """A record naming a file:function is a string handed to the rewards, never imported or called."""
    f = tmp_path / "evil.py"
    f.write_text("raise SystemExit('must not run')\ndef r(**k):\n    return [1.0]\n")
    (values,) = _score(
        ["exact_answer"], records=[{"prompt": "p", "answer": "4", "reward": f"{f}:r"}], completions=("4",)
    )
    assert values == [1.0]


@pytest.mark.parametrize(
    "specs, weights, message",
    [
        ([], [], "--objective grpo needs --reward"),
        (["exact"], [], "--reward exact: not a reward; give one of exact_answer"),
        (["missing.py:f"], [], "--reward missing.py:f: no file missing.py"),
        (["regex:("], [], "--reward regex:(: not a regular expression"),
        (["format", "length"], [1.0], "--reward-weights gives 1 weights for 2 --reward"),
    ],
)
def test_bad_rewards_are_one_line(specs, weights, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", "\\(").replace("$", "\\$")) as e:
        load_rewards(specs, weights, 10)
    assert "\n" not in str(e.value)


def test_user_file_without_the_function(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("x = 1\n")
    with pytest.raises(ConfigError, match=f"{f} has no function nope$"):
        load_rewards([f"{f}:nope"], [], 10)


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "raise KeyError('answer')",
            "reward {spec} raised KeyError: 'answer' \\(on the completions of prompts-file lines 1-2\\)",
        ),
        (
            "return [1.0, None, 0.0]",
            "reward {spec} returned None for a completion of prompts-file line 1: a reward must",
        ),
        ("return [1.0, 'x', 0.0]", "reward {spec} returned 'x' for a completion of prompts-file line 1"),
        ("return [float('nan')] * 3", "reward {spec} returned nan"),
        ("return [1.0]", "reward {spec} returned 1 values for 3 completions"),
    ],
)
def test_failing_reward_names_reward_and_record(tmp_path, body, message):
    f = tmp_path / "bad.py"
    f.write_text(f"def r(completions, **kwargs):\n    {body}\n")
    spec = f"{f}:r"
    with pytest.raises(RewardError, match="^" + message.format(spec=spec.replace(".", "\\."))) as e:
        _score([spec])
    assert "\n" not in str(e.value)
