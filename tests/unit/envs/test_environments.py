"""Environments: the reference's reset/step/render API, component metrics, and the batched API."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap
from fractions import Fraction

import pytest
import torch

import rl
import rl.environments as E
from rl.envs.base import ENV_REGISTRY, TextGenerationEnv, register_env, run_episode
from rl.envs.code import (
    CodeGenerationEnv,
    create_code_generation_env,
    extract_code,
    parse_unit_test,
    unit_test_passes,
)
from rl.envs.isolation import private_root_available
from rl.envs.math import create_math_problem_env
from rl.envs.objectives import MultiObjectiveRewardEnv, PreferenceComparisonEnv
from rl.envs.registry import ENV_TYPES, env_types, make_env
from rl.errors import DataError
from rl.rewards.answers import parse_number


@pytest.fixture(scope="module")
def tok():
    from rl.models.tiny import build_tokenizer

    return build_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def play(env, tok, text, eos=True):
    """Step `text` one token at a time (then EOS); return the last StepResult."""
    result = None
    for t in ids(tok, text) + ([tok.eos_token_id] if eos else []):
        result = env.step(t)
        if result.done:
            break
    return result


# ------------------------------------------------------------------------------- text generation

def test_public_names_importable_from_rl():
    for name in ("Observation", "StepResult", "Trajectory", "TextGenerationEnv", "MultiObjectiveRewardEnv",
                 "PreferenceComparisonEnv", "create_math_problem_env", "create_code_generation_env"):
        assert getattr(rl, name) is getattr(E, name)


def test_text_env_reset_step_render_default_length_reward(tok):
    env = TextGenerationEnv(tok, ["Tell me: ", "Other"], max_length=64)
    obs = env.reset()
    assert obs.prompt == "Tell me: " and obs.input_ids.shape == (1, 9) and obs.attention_mask.sum() == 9
    r = env.step(ids(tok, "a")[0])
    assert not r.done and r.reward == 0.0 and r.next_observation.input_ids.shape == (1, 10)
    assert r.next_observation.input_ids[0, -1].item() == ids(tok, "a")[0]
    r = play(env, tok, " b c")
    assert r.done and r.next_observation is None and r.info["stop_reason"] == "eos"
    assert r.reward == pytest.approx(3 / 100)  # "a b c": 3 words / 100, the documented default
    assert r.metrics["reward"] == r.reward and r.metrics["length"] == 6  # "a b c" is 5 byte tokens, + EOS
    assert env.render() == "Prompt: Tell me: \nGenerated: a b c\nSteps: 6\nReward: 0.0300"
    with pytest.raises(RuntimeError, match="reset"):
        env.step(1)
    assert env.reset().prompt == "Other"  # round robin


def test_text_env_stop_sequence_and_max_length(tok):
    env = TextGenerationEnv(tok, ["Q"], max_length=6, stop_sequences=["\n\n"],
                              reward_fn=lambda prompt, generated, full_text: float(len(generated)))
    env.reset()
    r = play(env, tok, "ab\n\ncd", eos=False)
    assert r.done and r.info["stop_reason"] == "stop_sequence"
    assert r.reward == 2.0  # scored on "ab", the text before the stop sequence
    env.reset()
    r = play(env, tok, "abcdefgh", eos=False)
    assert r.done and r.info["stop_reason"] == "max_length" and r.metrics["length"] == 5  # 1 + 5 = max_length
    with pytest.raises(ValueError, match="max_length"):
        TextGenerationEnv(tok, ["x" * 10], max_length=4).reset()


def test_text_env_accepts_tensor_and_multi_token_actions(tok):
    env = TextGenerationEnv(tok, ["P"], max_length=32)
    env.reset()
    env.step(torch.tensor(ids(tok, "hi")[0]))
    r = env.step(torch.tensor(ids(tok, "i there") + [tok.eos_token_id, 65]))  # tokens after EOS are dropped
    assert r.done and env.generated_text == "hi there" and r.reward == pytest.approx(0.02)


def test_batched_score_matches_step_and_takes_batched_reward_fn(tok):
    def batched(prompts, responses, metadata=None):
        return [len(p) + 10 * len(r) for p, r in zip(prompts, responses)]

    env = TextGenerationEnv(tok, ["ab", "c"], reward_fn=batched, stop_sequences=["\n"])
    rewards, metrics = env.score(["ab", "c"], ["xy\nignored", ""])
    assert rewards == [22.0, 1.0] and metrics["reward"] == rewards
    assert env(["ab"], ["x"]) == [12.0]
    env.reset(0)
    assert play(env, tok, "xy").reward == 22.0  # the per-token path gives the same reward
    with pytest.raises(ValueError, match="one prompt per completion"):
        env.score(["ab"], ["x", "y"])


def test_sample_prompts_deterministic(tok):
    env = TextGenerationEnv(tok, [f"p{i}" for i in range(10)], metadata=[{"i": i} for i in range(10)])
    a, b = env.sample_prompts(4, seed=3), env.sample_prompts(4, seed=3)
    assert a == b and len({x["prompt"] for x in a}) == 4
    assert all(x["metadata"]["i"] == int(x["prompt"][1:]) for x in a)
    assert len(env.sample_prompts(25, seed=0)) == 25


def test_run_episode_trajectory(tok):
    env = TextGenerationEnv(tok, ["P"], max_length=16)
    script = iter(ids(tok, "one two") + [tok.eos_token_id])
    traj = run_episode(env, lambda obs: (next(script), torch.tensor(-0.5)))
    assert traj.done and len(traj.actions) == 8 == len(traj.rewards) == len(traj.logprobs) == len(traj.observations)
    assert traj.total_reward == pytest.approx(0.02) and traj.rewards[:-1] == [0.0] * 7
    assert traj.observations[3].input_ids.shape == (1, 4)


def test_sample_action_uses_temperature(tok):
    env = TextGenerationEnv(tok, ["P"], temperature=1e-4)
    logits = torch.zeros(300)
    logits[42] = 1.0
    assert all(env.sample_action(logits).item() == 42 for _ in range(5))  # near-greedy at tiny temperature


# ------------------------------------------------------------------------------- multi-objective

def test_multi_objective_component_metrics(tok):
    def correctness(prompt, generated, full_text):
        return 1.0 if "42" in generated else 0.0

    def formatting(prompt, generated, full_text):
        return 0.5 if generated.startswith("A:") else 0.0

    env = MultiObjectiveRewardEnv(tok, ["Q?"], reward_components={"correctness": correctness, "formatting": formatting},
                                    reward_weights={"correctness": 1.0, "formatting": 0.1})
    env.reset()
    r = play(env, tok, "A: 42")
    assert r.metrics["reward_correctness"] == 1.0 and r.metrics["reward_formatting"] == 0.5
    assert r.reward == pytest.approx(1.0 * 1.0 + 0.1 * 0.5) == r.metrics["reward_total"]
    rewards, metrics = env.score(["Q?", "Q?"], ["A: 41", "42"])
    assert rewards == pytest.approx([0.05, 1.0])
    assert metrics["reward_formatting"] == [0.5, 0.0] and metrics["reward_correctness"] == [0.0, 1.0]
    with pytest.raises(ValueError, match="weight only existing"):
        MultiObjectiveRewardEnv(tok, ["Q"], reward_components={"a": correctness}, reward_weights={"b": 1.0})


def test_component_with_metadata(tok):
    def needs_meta(prompt, generated, full_text, metadata=None):
        return float(generated == metadata["target"])

    env = MultiObjectiveRewardEnv(tok, ["Q"], reward_components={"match": needs_meta},
                                    metadata=[{"target": "yes"}])
    assert env.score(["Q", "Q"], ["yes", "no"])[0] == [1.0, 0.0]  # metadata looked up by prompt
    assert env.score(["Z"], ["no"], [{"target": "no"}])[0] == [1.0]


# ------------------------------------------------------------------------------- preferences

class LengthScorer:
    """A stand-in reward model: score(texts) -> tensor of lengths."""

    def score(self, texts):
        return torch.tensor([float(len(t)) for t in texts])


def test_preference_env_with_scorer(tok):
    env = PreferenceComparisonEnv(tok, ["Q: "], preference_model=LengthScorer())
    obs = env.reset()
    assert obs.metadata["comparison_round"] == 0
    r1 = env.step(ids(tok, "short"))
    assert not r1.done and r1.reward == 0.0 and r1.next_observation.metadata["comparison_round"] == 1
    r2 = env.step("much longer answer")
    assert r2.done and r2.reward == pytest.approx(5 - 18)  # Bradley-Terry margin score(r1) - score(r2)
    assert r2.info["preferred"] == 1
    assert r2.metrics["preference_prob"] == pytest.approx(1 / (1 + math.exp(13)))
    assert "Response 2: much longer answer" in env.render()
    rewards, metrics = env.score(["Q: ", "Q: "], ["ab", "abcd"])  # pointwise scores for trainers
    assert rewards == [5.0, 7.0] and metrics["reward_model_score"] == rewards


def test_preference_env_with_callable_and_human_feedback(tok):
    env = PreferenceComparisonEnv(tok, ["Q"], preference_model=lambda texts: [t.count("!") for t in texts])
    env.reset()
    env.step("hi!!")
    assert env.step("hi").reward == 2.0
    fb = PreferenceComparisonEnv(tok, ["Q"], human_feedback_fn=lambda p, a, b: 1.0 if len(a) < len(b) else -1.0)
    fb.reset()
    fb.step("a")
    r = fb.step("bbb")
    assert r.reward == 1.0 and r.info["preferred"] == 0
    assert fb.compare(["Q", "Q"], ["aaaa", "a"], ["b", "bb"])[0] == [-1.0, 1.0]
    with pytest.raises(ValueError, match="needs one"):
        fb.score(["Q"], ["x"])


def test_preference_env_requires_a_source(tok):
    with pytest.raises(ValueError, match="never guesses"):
        PreferenceComparisonEnv(tok, ["Q"])


def test_preference_env_with_hf_classifier(tok, tiny_llama):
    from rl.models.loading import load_causal_lm, load_tokenizer

    torch.manual_seed(0)  # the causal-LM checkpoint loads with a fresh score head, as reward models start
    model = load_causal_lm(tiny_llama, dtype="float32", task="classifier")
    rtok = load_tokenizer(tiny_llama)
    env = PreferenceComparisonEnv(tok, ["Q: "], preference_model=model, reward_tokenizer=rtok)
    env.reset()
    env.step("good answer")
    r = env.step("bad")
    with torch.no_grad():
        s = [model(**rtok(t, return_tensors="pt")).logits[0, 0].item() for t in ("Q: good answer", "Q: bad")]
    assert r.reward == pytest.approx(s[0] - s[1], abs=1e-5)  # padded batch == one-by-one scores
    assert r.reward != 0.0
    env.reset()
    env.step("good answer")
    assert env.step("bad").reward == pytest.approx(r.reward, abs=1e-6)  # deterministic, never random


# ------------------------------------------------------------------------------- math

def test_math_env_reset_step_render_and_rewards(tok):
    env = create_math_problem_env(tok, difficulty="tiny", num_problems=20, seed=0)
    obs = env.reset()
    assert re.fullmatch(r"\d\+\d=", obs.prompt)
    a, b = map(int, obs.metadata["problem"].split("+"))
    assert obs.metadata["answer"] == str(a + b)
    r = play(env, tok, str(a + b))
    assert r.done and r.metrics["reward_correctness"] == 1.0 and r.metrics["reward_formatting"] == 1.0
    assert r.reward == pytest.approx(1.1)
    assert f"Generated: {a + b}" in env.render()
    env.reset(0)
    r = play(env, tok, str(a + b + 1))
    assert r.metrics["reward_correctness"] == 0.0 and r.reward == pytest.approx(0.1)  # format only
    env.reset(0)
    assert play(env, tok, "incorrect").reward == 0.0


def test_math_env_batched_table(tok):
    env = create_math_problem_env(tok, difficulty="easy", answer_format="answer")
    batch = env.sample_prompts(4, seed=7)
    assert batch == env.sample_prompts(4, seed=7) and batch[0]["prompt"].startswith("Question: What is ")
    meta = [{"answer": "-3"}, {"answer": "-3"}, {"answer": "3/4"}, {"answer": "12"}, {"answer": "12"}]
    completions = ["Answer: -3", "Answer: 3", "so \\boxed{0.75}", "correct!", "Answer: 12 or 13"]
    rewards, metrics = env.score([b["prompt"] for b in batch] + ["x"], completions, meta)
    assert metrics["reward_correctness"] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert metrics["reward_formatting"] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert rewards == pytest.approx([1.1, 0.1, 1.0, 0.0, 0.1])
    with pytest.raises(ValueError, match="no 'answer'"):
        env.score(["unknown prompt"], ["1"])


def test_math_train_test_split_is_disjoint_and_stable(tok):
    train = create_math_problem_env(tok, difficulty="tiny", num_problems=500, seed=1)
    test = create_math_problem_env(tok, difficulty="tiny", num_problems=200, seed=2, split="test")
    tr, te = {p["problem"] for p in train.problems}, {p["problem"] for p in test.problems}
    assert tr.isdisjoint(te) and len(tr) + len(te) == 100  # all 100 tiny problems, split ~80/20
    assert 10 <= len(te) <= 30
    fresh = {b["metadata"]["problem"] for b in train.sample_prompts(200, seed=9)}
    assert fresh <= tr
    sft = train.sft_records(3, seed=0)
    assert all(r["completion"] == str(eval_sum(r["prompt"])) for r in sft)


def eval_sum(prompt):  # "3+4=" -> 7, parsed by hand (no eval)
    a, b = prompt.rstrip("=").split("+")
    return int(a) + int(b)


def test_math_hard_problems_have_exact_answers(tok):
    env = create_math_problem_env(tok, difficulty="hard", num_problems=200, seed=3, split="all")
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "/": lambda x, y: x / y}
    saw_fraction = False
    for p in env.problems:
        a, o1, b, o2, c = re.fullmatch(r"\((\d+)([-+*])(\d+)\)([-+*/])(\d+)", p["problem"]).groups()
        value = ops[o2](ops[o1](Fraction(a), Fraction(b)), Fraction(c))
        assert parse_number(p["answer"]) == value
        saw_fraction |= "/" in p["answer"]
    assert saw_fraction


def test_math_env_from_jsonl(tok, tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text('{"problem": "What is half of 3?", "answer": 1.5}\n{"problem": "2-5", "answer": "-3"}\n')
    env = create_math_problem_env(tok, problems_path=str(path), answer_format="boxed")
    assert [p["answer"] for p in env.problems] == ["1.5", "-3"]
    rewards, _ = env.score(env.prompts, ["\\boxed{3/2}", "\\boxed{3}"])
    assert rewards == pytest.approx([1.1, 0.1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": 2}\n{"problem": "2+2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'answer'"):
        create_math_problem_env(tok, problems_path=str(bad))


# ------------------------------------------------------------------------------- code

# Where bubblewrap cannot give a private root, run these anyway (tests/unit/envs/test_security.py covers isolation).
SANDBOX = "isolated" if private_root_available() else "unisolated"

def test_code_env_syntax_and_style(tok):
    env = create_code_generation_env(tok)
    obs = env.reset()
    assert obs.prompt.startswith("Write a Python function add")
    good = 'def add(a, b):\n    """Sum."""\n    return a + b\n'
    r = play(env, tok, "```python\n" + good + "```\nDone.")
    assert r.metrics["reward_syntax"] == 1.0 and r.metrics["reward_style"] == 1.0
    assert r.reward == pytest.approx(1.1)
    assert "reward_tests" not in r.metrics
    rewards, m = env.score([obs.prompt] * 4, ["", "def f(:\n", "x = 1\n", "def f():\n\treturn 1  \n"])
    assert m["reward_syntax"] == [0.0, 0.0, 1.0, 1.0]  # the empty string earns nothing (reference bug)
    assert m["reward_style"][:2] == [0.0, 0.0]
    assert m["reward_style"][2] == pytest.approx(4 / 6)   # no function, no docstring
    assert m["reward_style"][3] == pytest.approx(4 / 6)   # no docstring, tab + trailing space


def test_code_env_unit_tests_run_in_sandbox_only(tok, monkeypatch):
    import rl.envs.sandbox

    calls = []
    real = rl.envs.sandbox.run_python

    def counting(code, **kw):
        calls.append(code)
        return real(code, **kw)

    monkeypatch.setattr(rl.envs.sandbox, "run_python", counting)
    monkeypatch.delenv("RL_SANDBOX_PWNED", raising=False)
    env = create_code_generation_env(tok, run_tests=True, timeout=3.0, sandbox=SANDBOX)
    prompt = env.prompts[1]  # factorial
    right = "def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n"
    wrong = "def factorial(n):\n    return n\n"  # passes factorial(1) only
    leak = "import os\nos.environ['RL_SANDBOX_PWNED'] = '1'\ndef factorial(n):\n    return 1\n"
    cheat = "print('__rl_test_0:')\nimport sys\nsys.exit(0)\n"  # guesses a marker, then exits before tests
    rewards, m = env.score([prompt] * 5, [right, wrong, leak, cheat, "def factorial(n:"])
    assert m["reward_tests"] == pytest.approx([1.0, 1 / 3, 2 / 3, 0.0, 0.0])
    assert rewards[0] == pytest.approx(1.0 + 0.1 * (5 / 6) + 1.0)
    assert len(calls) == 4  # unparseable code never reaches a subprocess
    assert "RL_SANDBOX_PWNED" not in os.environ  # nothing ran in this process


@pytest.mark.slow
def test_code_env_infinite_loop_scores_zero(tok):
    env = create_code_generation_env(tok, run_tests=True, timeout=1.0, sandbox=SANDBOX)
    rewards, m = env.score([env.prompts[0]], ["def add(a, b):\n    while True:\n        pass\n"])
    assert m["reward_tests"] == [0.0]


def test_unit_test_forms_and_their_checks():
    t = parse_unit_test("assert 120 == factorial(5)")
    assert (t.function, t.args, t.op, t.expected) == ("factorial", ("5",), "==", 120)
    t = parse_unit_test("assert f([1, -2], key={'a': (1,)}) is None")
    assert (t.args, t.kwargs, t.op, t.expected) == (("[1, -2]",), (("key", "{'a': (1,)}"),), "is", None)
    cases = [("assert f(1) == 3", "3", True), ("assert f(1) == 3", "3.0", True), ("assert f(1) == 3", "4", False),
             ("assert f('a')", "'x'", True), ("assert f('a')", "0", False), ("assert not f('a')", "[]", True),
             ("assert 2 in f()", "[1, 2]", True), ("assert f() in (1, 2)", "3", False),
             ("assert f() < 1.5", "1", True), ("assert f() is not None", "None", False)]
    for test, value, passes in cases:
        assert unit_test_passes(parse_unit_test(test), {"i": 0, "repr": value}) is passes, (test, value)
    for bad in ["assert abs(f(1) - 2) < 1e-6", "x = f(1)\nassert x == 2", "assert f(1) == g(2)",
                "assert f(1) is 3", "assert f(a)", "assert f(1) == [x for x in y]", "assert 1 < f(1) < 3", "f(1)"]:
        with pytest.raises(ValueError, match="write each test as"):
            parse_unit_test(bad)


def test_code_env_rejects_unit_tests_it_cannot_judge(tok, tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"prompt": "Write f.", "tests": ["assert f(1) == 2"]}) + "\n"
                    + json.dumps({"prompt": "Write g.", "tests": ["assert abs(g(1) - 2) < 1e-6"]}) + "\n")
    with pytest.raises(DataError, match=r"code.jsonl:2: unit test 'assert abs"):
        create_code_generation_env(tok, problems_path=str(path), run_tests=True, sandbox=SANDBOX)
    env = create_code_generation_env(tok, problems_path=str(path))  # without run_tests nothing runs them
    assert len(env.prompts) == 2


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore") == "x = 1\n"
    assert extract_code("x = 2\n```\ntrailing", prompt="Solve:\n```python\n") == "x = 2\n"
    assert extract_code("y = 3") == "y = 3"


# ------------------------------------------------------------------------------- factory

def test_make_env_all_types(tok, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "Hello", "answer": "5"}\n{"text": "World", "answer": "6"}\n')
    t = make_env("text_generation", tok, {"prompts_path": str(prompts), "reward_fn": "correctness"})
    assert t.score(["Hello", "World"], ["Answer: 5", "7"])[0] == [1.0, 0.0]  # answers from the data rows
    mo = make_env("multi_objective", tok, json.dumps(
        {"prompts": ["Q"], "metadata": [{"answer": "5"}], "reward_weights": {"correctness": 1.0, "formatting": 0.1}}))
    rewards, metrics = mo.score(["Q"], ["Answer: 5"])
    assert rewards == pytest.approx([1.1]) and set(metrics) == {"reward_correctness", "reward_formatting", "reward_total"}
    pc = make_env("preference_comparison", tok, {"prompts": ["Q"], "preference_model": LengthScorer()})
    assert pc.score(["Q"], ["ab"])[0] == [3.0]
    m = make_env("math", tok, '{"difficulty": "tiny", "num_problems": 5}')
    assert len(m.prompts) == 5
    c = make_env("code", tok, {})
    assert isinstance(c, CodeGenerationEnv)
    with pytest.raises(ValueError, match="choose one of"):
        make_env("atari", tok, {})
    with pytest.raises(ValueError, match="bad config for environment 'math'"):
        make_env("math", tok, {"dificulty": "tiny"})
    with pytest.raises(ValueError, match="not valid JSON"):
        make_env("math", tok, "{oops")
    with pytest.raises(ValueError, match="'prompts'"):
        make_env("text_generation", tok, {})


def test_env_registry(tok):
    assert ENV_TYPES == ("code", "math", "multi_objective", "preference_comparison", "text_generation", "tool_math")
    assert env_types() == tuple(sorted(ENV_REGISTRY)) == ENV_TYPES

    def make(tokenizer, **config):
        return TextGenerationEnv(tokenizer, ["Q"], **config)

    assert register_env("test_echo", make) is make
    try:
        @register_env("test_echo_2")
        def make_2(tokenizer, **config):
            return TextGenerationEnv(tokenizer, ["R"], **config)

        assert env_types() == tuple(sorted((*ENV_TYPES, "test_echo", "test_echo_2")))
        assert make_env("test_echo", tok, {"max_length": 64}).max_length == 64
        assert make_env("test_echo_2", tok, None).prompts == ["R"]
        assert register_env("test_echo", make) is make  # the same factory again (a module reload) is fine
        with pytest.raises(ValueError, match=r"'test_echo' is already registered \(.*make\)"):
            register_env("test_echo", make_2)
        with pytest.raises(ValueError, match="'math' is already registered"):
            register_env("math")(make)
        with pytest.raises(ValueError, match="bad config for environment 'test_echo'"):
            make_env("test_echo", tok, {"max_lenght": 64})
    finally:
        ENV_REGISTRY.pop("test_echo", None)
        ENV_REGISTRY.pop("test_echo_2", None)
    for bad in ("", "pkg:make", None):
        with pytest.raises(ValueError, match="without ':'"):
            register_env(bad)
    with pytest.raises(ValueError, match=r"unknown environment type 'atari'; choose one of code, math, "
                                         r"multi_objective, .*, tool_math or give 'module:function'"):
        make_env("atari", tok, {})


def test_make_env_from_a_user_module(tok, tmp_path, monkeypatch):
    (tmp_path / "mymod.py").write_text(textwrap.dedent('''
        from rl.envs.base import TextGenerationEnv

        def make(tokenizer, prompts, bonus=0.0, max_length=32):
            return TextGenerationEnv(tokenizer, prompts, max_length=max_length,
                                     reward_fn=lambda prompt, generated, full_text: len(generated) + bonus)

        not_a_factory = 3
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env = make_env("mymod:make", tok, {"prompts": ["Q", "R"], "bonus": 0.5})
        assert isinstance(env, TextGenerationEnv) and env.prompts == ["Q", "R"] and env.max_length == 32
        assert env.score(["Q"], ["abc"])[0] == [3.5]
        assert make_env("mymod:make", tok, '{"prompts": ["Q"]}').score(["Q"], ["ab"])[0] == [2.0]  # JSON config
        obs = env.reset(0)  # the per-token API works as for a built-in environment
        assert obs.prompt == "Q" and env.step(tok.eos_token_id).done
        with pytest.raises(ValueError, match="bad config for environment 'mymod:make'"):
            make_env("mymod:make", tok, {"prompts": ["Q"], "malus": 1})
        with pytest.raises(ValueError, match="module 'mymod' has no callable 'not_a_factory'"):
            make_env("mymod:not_a_factory", tok, {})
        with pytest.raises(ValueError, match="cannot import environment module 'no_such_module_here'"):
            make_env("no_such_module_here:make", tok, {})
        for bad in ("mymod:", ":make", "mymod:make:extra"):
            with pytest.raises(ValueError, match="'package.module:function'"):
                make_env(bad, tok, {})
        assert "mymod:make" not in env_types()  # a path is looked up each time, never registered
    finally:
        sys.modules.pop("mymod", None)


# ------------------------------------------------------------------------------- trainer adapters

def test_reward_functions_for_grpo(tok):
    env = create_math_problem_env(tok, difficulty="tiny", num_problems=5)
    funcs, weights = env.reward_functions()
    assert [f.__name__ for f in funcs] == ["correctness", "formatting"] and weights == [1.0, 0.1]
    prompts = ["1+2=", "1+2=", "3+3="]
    completions = ["3", "Answer: 4", [{"role": "assistant", "content": "6"}]]
    answer = ["3", "3", "6"]
    assert funcs[0](prompts, completions, answer=answer) == [1.0, 0.0, 1.0]
    assert funcs[1](prompts, completions, answer=answer) == [1.0, 0.0, 1.0]
    text_funcs, text_weights = TextGenerationEnv(tok, ["p"]).reward_functions()
    assert text_funcs[0](["p"], ["a b"]) == [0.02] and text_weights == [1.0]


def test_trl_style_reward_fn_in_env(tok):
    def trl_fn(prompts, completions, answer, **kwargs):
        return [1.0 if c == a else None for c, a in zip(completions, answer)]

    env = TextGenerationEnv(tok, ["p"], reward_fn=trl_fn)
    assert env.score(["p", "p"], ["x", "y"], [{"answer": "x"}, {"answer": "x"}])[0] == [1.0, 0.0]


def test_batched_api_needs_no_tokenizer_and_fills_empty_metadata():
    env = create_math_problem_env(None, difficulty="tiny", num_problems=3, seed=4)
    p = env.prompts[0]
    answer = env.metadata[0]["answer"]
    assert env.score([p, p], [answer, "x"], [{}, None])[0] == pytest.approx([1.1, 0.0])
