"""TRL's reward functions by TRL's names (rl.rewards.functions, TRL 1.16's trl.rewards): each gives TRL's values on
identical inputs, in TRL's conversational form and as plain strings, and resolves by name in reward_funcs."""

import pytest

from rl.rewards import functions as ours
from rl.trainers.rewards import FunctionReward, resolve_reward_func

import trl.rewards as trl_rewards  # noqa: E402 - TRL is pinned in the dev extra

SOLUTIONS = [r"\frac{1}{3}", r"\frac{1}{3}", "7", "42", "x^2", r"\sqrt{2}", "unparseable gold ]]", "10"]
TEXTS = [r"My answer is \boxed{\frac{1}{3}}", r"My answer is \boxed{\frac{1}{2}}", r"So \boxed{7}.", "It is 42.",
         r"<think>square it</think> The answer is $x^2$", r"<think>hmm \boxed{\sqrt{2}}", r"\boxed{3}",
         r"<think>a</think><think>b</think> \boxed{10}"]
IDS = [[1] * 50, [1] * 10, [1, 2, 3, 1, 2, 3, 1, 2], [5] * 9, [], [1, 2], [4] * 120, list(range(30))]


def _chat(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


@pytest.mark.parametrize("name", ["accuracy_reward", "reasoning_accuracy_reward"])
def test_accuracy_rewards_match_trl(name):
    want = getattr(trl_rewards, name)(_chat(TEXTS), SOLUTIONS)
    assert getattr(ours, name)(_chat(TEXTS), SOLUTIONS) == want
    assert getattr(ours, name)(TEXTS, SOLUTIONS) == want  # plain strings, as this package's trainers pass them
    assert {0.0, 1.0} <= set(want) and None in want  # right, wrong and a skipped example all exercised


def test_think_format_matches_trl():
    want = trl_rewards.think_format_reward(_chat(TEXTS))
    assert ours.think_format_reward(TEXTS) == want and set(want) == {0.0, 1.0}


@pytest.mark.parametrize("max_len", [40, 100])
def test_cosine_scaled_matches_trl(max_len):
    want = trl_rewards.get_cosine_scaled_reward(max_len=max_len)(_chat(TEXTS), SOLUTIONS, IDS)
    assert ours.get_cosine_scaled_reward(max_len=max_len)(TEXTS, SOLUTIONS, IDS) == pytest.approx(want)


@pytest.mark.parametrize("n,penalty", [(2, -1.0), (3, -0.5)])
def test_repetition_penalty_matches_trl(n, penalty):
    want = trl_rewards.get_repetition_penalty_reward(ngram_size=n, max_penalty=penalty)(IDS)
    assert ours.get_repetition_penalty_reward(ngram_size=n, max_penalty=penalty)(IDS) == pytest.approx(want)
    assert min(want) < 0
    with pytest.raises(ValueError, match="should not be positive"):
        ours.get_repetition_penalty_reward(max_penalty=0.5)


def test_soft_overlong_matches_trl():
    want = trl_rewards.get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=80)(IDS)
    assert ours.get_soft_overlong_punishment(100, 80)(IDS) == pytest.approx(want)
    assert {0.0, -1.0} <= set(want) and any(-1.0 < w < 0.0 for w in want)


def test_trls_names_resolve_in_reward_funcs_and_score_through_the_reward_protocol():
    """By name as TRL's grpo script has them (its registry: the soft overlong punishment at 1280/256), called with
    the columns the trainers pass (the rows' other fields and completion_ids)."""
    assert set(ours.TRL_REWARD_FUNCTIONS) == {"accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                                               "get_soft_overlong_punishment"}
    columns = {"solution": SOLUTIONS, "completion_ids": IDS}
    for name in ours.TRL_REWARD_FUNCTIONS:
        source = resolve_reward_func(name)
        assert isinstance(source, FunctionReward) and source.convention == "trl" and source.name == name
        values, _ = source(["p"] * len(TEXTS), TEXTS, columns)
        assert values.shape == (len(TEXTS),)
    acc, _ = resolve_reward_func("accuracy_reward")(["p"] * len(TEXTS), TEXTS, columns)
    skipped = [v is None for v in trl_rewards.accuracy_reward(_chat(TEXTS), SOLUTIONS)]
    assert acc.isnan().tolist() == skipped and acc[0] == 1.0 and acc[1] == 0.0  # None: no score (NaN)
    # TRL's dotted form of a user's function (module.function) resolves as module:function does
    assert resolve_reward_func("rl.rewards.functions.think_format_reward").fn is ours.think_format_reward
