"""The one reward protocol (rl/trainers/rewards.py): each adapter with hand-checked values, weighted sums
with None, named failures, the config rules (combine with reward_weights, command line replaces the
recipe, ref_model alone -> reward_fn=default), and GRPO / PPO scoring with a reward model."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rl.config.fields import build
from rl.config.parse import parse_config
from rl.envs.math import create_math_problem_env
from rl.errors import ConfigError, RunError
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.ppo import PPOTrainer
from rl.trainers.ppo_config import PPOConfig, check_reward_source
from rl.trainers.ppo_rewards import build_reward_source
from rl.trainers.rewards import (
    EnvironmentReward,
    FunctionReward,
    RewardError,
    RewardModelReward,
    WeightedSum,
    combine_rewards,
    resolve_reward_func,
    rows_to_columns,
)
from tests.conftest import ROOT

P, C = ["p1 ", "p2 "], ["one two", "Answer: 4"]


# ------------------------------------------------------------------------------ adapters

def test_function_signatures():
    def trl(prompts, completions, answer, **kw):
        return [1.0 if c.endswith(a) else 0.0 for c, a in zip(completions, answer)]

    def reference(prompts, responses, metadata):
        return [float(len(r)) + m["bonus"] for r, m in zip(responses, metadata)]

    def pair(prompts, responses):
        return [float(len(p)) for p in prompts]

    cols = {"answer": ["two", "5"], "bonus": [0.5, 1.0]}
    assert FunctionReward(trl)(P, C, cols)[0].tolist() == [1.0, 0.0]
    assert FunctionReward(reference)(P, C, cols)[0].tolist() == [7.5, 10.0]
    assert FunctionReward(pair)(P, C, cols)[0].tolist() == [3.0, 3.0]
    assert FunctionReward(trl).name == "trl"


def test_named_and_module_functions():
    values, _ = resolve_reward_func("default")(P, C, {})
    torch.testing.assert_close(values, torch.tensor([0.02, 0.02]))  # words / 100
    f = resolve_reward_func("correctness")
    assert f.name == "correctness" and f(P, C, {"answer": ["3", "4"]})[0].tolist() == [0.0, 1.0]
    g = resolve_reward_func("rl.rewards.functions:char_fraction_reward")
    assert g.name == "char_fraction_reward"
    torch.testing.assert_close(g(["p"], ["aab"], {})[0], torch.tensor([2 / 3]))
    with pytest.raises(ConfigError, match="unknown reward function 'nope'"):
        resolve_reward_func("nope")


def test_environment_keeps_components(tiny_tokenizer):
    env = create_math_problem_env(tiny_tokenizer, difficulty="easy", answer_format="answer")
    prompts = [b["prompt"] for b in env.sample_prompts(2, seed=7)]
    cols = rows_to_columns([{"answer": "-3"}, {"answer": "3/4"}], 2)
    values, metrics = EnvironmentReward(env)(prompts, ["Answer: -3", "so \\boxed{0.5}"], cols)
    torch.testing.assert_close(values, torch.tensor([1.1, 0.0]))  # correctness + 0.1 * formatting
    assert metrics["correctness"].tolist() == [1.0, 0.0] and metrics["formatting"].tolist() == [1.0, 0.0]


class LengthModel:
    """A stand-in reward model: the length of the text it is given."""

    def __init__(self):
        self.texts = []

    def score(self, texts):
        self.texts += texts
        return torch.tensor([float(len(t)) for t in texts])


def test_reward_model_scores_prompt_plus_completion():
    m = LengthModel()
    values, _ = RewardModelReward(m)(P, C, {})
    assert m.texts == ["p1 one two", "p2 Answer: 4"] and values.tolist() == [10.0, 12.0]


def test_weighted_sum_none_semantics_equal_combine_rewards():
    a = FunctionReward(lambda prompts, completions, **kw: [1.0, None, None, -1.0], "a")
    b = FunctionReward(lambda prompts, completions, **kw: [2.0, 3.0, None, 0.5], "b")
    total, metrics = WeightedSum([a, b], [2.0, 1.0])(["p"] * 4, ["x"] * 4, {})
    # 2*1 + 2 = 4; None left out -> 3; all None -> NaN; 2*(-1) + 0.5 = -1.5
    assert total[[0, 1, 3]].tolist() == [4.0, 3.0, -1.5] and math.isnan(total[2])
    per = torch.stack([metrics["a"], metrics["b"]], 1)
    torch.testing.assert_close(combine_rewards(per, [2.0, 1.0]), total, equal_nan=True)
    with pytest.raises(ConfigError, match="reward_weights has 1 entries but there are 2"):
        WeightedSum([a, b], [1.0])


# ------------------------------------------------------------------------------ failures

def _raises(prompts, completions, **kw):
    raise KeyError("answer")


def _hangs(prompts, completions, **kw):
    time.sleep(30)


@pytest.mark.parametrize("fn,needle", [
    (_raises, "'_raises' raised KeyError: 'answer'"),
    (lambda prompts, completions, **kw: [float("nan"), 1.0], "'bad' returned nan for completion 0"),
    (lambda prompts, completions, **kw: [1.0, float("inf")], "'bad' returned inf for completion 1"),
    (lambda prompts, completions, **kw: [1.0], "'bad' returned 1 values for 2 completions"),
    (lambda prompts, completions, **kw: ["1.0", "2.0"], "'bad' returned str '1.0' for completion 0"),
    (lambda prompts, completions, **kw: "1.0", "'bad' returned str '1.0'"),
])
def test_failures_name_the_function(fn, needle):
    name = None if fn is _raises else "bad"
    with pytest.raises(RewardError, match=needle) as e:
        FunctionReward(fn, name)(P, C, {})
    assert isinstance(e.value, RunError) and "\n" not in str(e.value)


def test_timeout_names_the_function():
    # _hangs sleeps 30 s: only the 0.2 s timeout gives this error (the message, not a stopwatch, proves it)
    with pytest.raises(RewardError, match=r"'_hangs' did not return within reward_timeout=0.2 s"):
        FunctionReward(_hangs, timeout=0.2)(P, C, {})


def test_failure_in_grpo_training_is_a_named_run_error(tiny_llama, tmp_path):
    cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                                 max_completion_length=2, max_length=12, max_steps=1, report_to=["none"],
                                 reward_timeout=0.5))
    with pytest.raises(RewardError, match="'_hangs' did not return within reward_timeout=0.5"):
        GRPOTrainer(cfg, reward_funcs=[_hangs], train_prompts=[{"prompt": "1+1="}, {"prompt": "2+2="}]).train()


def test_failure_through_the_launch_script_is_one_line(tmp_path, tiny_cache):
    (tmp_path / "badrewards.py").write_text("def nan_reward(prompts, completions, **kw):\n"
                                            "    return [float('nan')] * len(completions)\n")
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "RL_TINY_CACHE": str(tiny_cache), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "launch/grpo.py", "--config", "recipes/tiny/grpo.yaml",
                        f"output_dir={tmp_path / 'out'}", "reward_funcs=[badrewards:nan_reward]", "max_steps=1",
                        "per_device_train_batch_size=8", "num_generations=2", "max_completion_length=2", "eval_steps=0",
                        "eval_env_config=null", "report_to=[none]"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 1, r.stderr[-2000:]
    assert lines[-1] == "error: reward function 'nan_reward' returned nan for completion 0; scores must be " \
                        "finite (return None for 'no score')", r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------ config rules

def test_ppo_sources_combine_only_with_reward_weights(tmp_path):
    with pytest.raises(ConfigError, match="give exactly one reward source, or reward_weights"):
        PPOConfig(model_name="m", reward_fn="default", reward_model_path="x")
    cfg = PPOConfig(model_name="m", reward_fn="default", reward_model_path="x", reward_weights={"reward_model": 2.0})
    assert cfg.reward_model_path == "x" and cfg.reward_fn == "default"


def test_reward_timeout_must_not_be_negative():
    for cls in (PPOConfig, GRPOConfig):
        with pytest.raises(ConfigError, match="reward_timeout"):
            cls(model_name="m", reward_fn="default", reward_timeout=-1) if cls is PPOConfig else \
                cls(model_name="m", reward_timeout=-1)


def test_command_line_reward_source_replaces_the_recipes():
    cfg = parse_config(PPOConfig, ["--config", "recipes/tiny/ppo.yaml", "reward_model_path=runs/rm"])
    assert cfg.reward_model_path == "runs/rm" and cfg.reward_fn is None and cfg.custom_reward is None
    cfg = parse_config(PPOConfig, ["--config", "recipes/tiny/ppo.yaml", "--rl-reward-model-path", "runs/rm",
                                   "--rl-reward-weights", '{"reward_model": 1.0, "char_fraction_reward": 0.5}'])
    assert cfg.reward_model_path == "runs/rm" and cfg.reward_fn == "custom"  # reward_weights: combine
    cfg = parse_config(PPOConfig, ["--config", "recipes/tiny/ppo.yaml", "beta=0.5"])
    assert cfg.reward_fn == "custom"  # no reward key on the command line: the recipe's source stays
    recipe = parse_config(GRPOConfig, ["--config", "recipes/tiny/grpo.yaml", "reward_funcs=[correctness]"])
    cfg = parse_config(GRPOConfig, ["--config", "recipes/tiny/grpo.yaml", "reward_funcs=[correctness]",
                                    "reward_weights=[1.0,0.5]"])
    assert recipe.env_type == cfg.env_type == "math" and cfg.reward_weights == [1.0, 0.5]  # the env stays


def test_ref_model_alone_uses_the_default_reward(caplog):
    cfg = PPOConfig(model_name="m", ref_model="tiny:qwen2")
    with caplog.at_level(logging.WARNING, logger="rl.trainers.ppo_config"):
        check_reward_source(cfg)
    assert cfg.reward_fn == "default" and len(caplog.records) == 1
    assert "using reward_fn=default" in caplog.records[0].getMessage()
    with pytest.raises(ConfigError, match="no reward source"):
        check_reward_source(PPOConfig(model_name="m"))


def test_ppo_mapping_weights_sources_and_components(tiny_tokenizer):
    """reward_weights {source: w} weights sources, other keys are the environment's component weights."""
    cfg = PPOConfig(model_name="m", reward_fn="default", multi_objective=True,
                    reward_weights={"default": 3.0, "env": 2.0, "length": 1.0, "formatting": 0.0})
    cfg.data.path = "data/tiny/ppo_prompts.jsonl"
    reward = build_reward_source(cfg, tiny_tokenizer)
    assert reward.names == ["env", "default"] and reward.weights.tolist() == [2.0, 3.0]
    total, parts = reward(P, C, {})
    torch.testing.assert_close(total, 2.0 * parts["env"] + 3.0 * torch.tensor([0.02, 0.02]))
    with pytest.raises(ConfigError, match="reward_weights names nope"):
        build_reward_source(PPOConfig(model_name="m", reward_fn="default", reward_weights={"nope": 1.0}),
                            tiny_tokenizer)


# ------------------------------------------------------------------------------ trainers with a reward model

@pytest.fixture(scope="module")
def tiny_rm(tiny_llama, tmp_path_factory):
    """A reward model trained 0 steps, saved as launch/reward.py saves one."""
    from rl.models.loading import load_tokenizer
    from rl.models.reward import RewardModel, RewardModelConfig

    rm = RewardModel(RewardModelConfig(model_name=tiny_llama, use_lora=False, dtype="float32"),
                     tokenizer=load_tokenizer(tiny_llama))
    return str(rm.save(tmp_path_factory.mktemp("rm") / "rm"))


def _spy(trainer) -> list[torch.Tensor]:
    rm = trainer.reward.find(RewardModelReward).model
    seen, score = [], rm.score

    def recording(texts):
        seen.append(score(texts))
        return seen[-1]

    rm.score = recording
    return seen


def test_grpo_with_a_reward_model(tiny_llama, tiny_rm, tmp_path):
    cfg = build(GRPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                                 max_completion_length=3, max_length=12, max_steps=1, report_to=["none"],
                                 rl_reward_model_path=tiny_rm))
    t = GRPOTrainer(cfg, train_prompts=[{"prompt": "1+1="}, {"prompt": "2+2="}])
    assert t.reward.names == ["reward_model"]
    seen = _spy(t)
    row = [r for r in t.train() if "reward" in r][0]
    assert len(seen) == 1 and seen[0].shape == (4,)
    assert row["rewards/reward_model/mean"] == pytest.approx(float(seen[0].mean()), abs=1e-6)
    assert row["reward"] == pytest.approx(float(seen[0].mean()), abs=1e-6)


def test_ppo_with_a_reward_model_and_an_environment_weighted(tiny_llama, tiny_rm, tmp_path):
    cfg = PPOConfig(model_name=tiny_llama, output_dir=str(tmp_path), reward_model_path=tiny_rm,
                    multi_objective=True, reward_weights={"reward_model": 0.5, "env": 2.0, "length": 1.0, "formatting": 0.1},
                    max_steps=1, per_device_train_batch_size=4, mini_batch_size=4, num_ppo_epochs=1, max_completion_length=3,
                    max_length=32, report_to=["none"])
    cfg.data.path = "data/tiny/ppo_prompts.jsonl"
    t = PPOTrainer(cfg)
    assert t.reward.names == ["env", "reward_model"] and t.reward.weights.tolist() == [2.0, 0.5]
    seen = _spy(t)
    prompts = [json.loads(ln)["text"] for ln in Path(cfg.data.path).read_text().splitlines()[:4]]
    row = t.train(prompts)[0]
    assert len(seen) == 1
    assert row["rewards/reward_model/mean"] == pytest.approx(float(seen[0].mean()), abs=1e-5)
    assert row["objective/scores"] == pytest.approx(
        2.0 * row["rewards/env/mean"] + 0.5 * row["rewards/reward_model/mean"], abs=1e-5)


def test_launch_with_only_model_ref_says_it_uses_the_default_reward(tmp_path, tiny_cache):
    r = subprocess.run([sys.executable, "launch/ppo.py", "--config", "recipes/tiny/ppo.yaml", "reward_fn=null",
                        "--model-ref", "tiny:llama", "--dry-run", f"output_dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "reward_fn=default" in ln]
    assert len(said) == 1 and said[0].startswith("no reward source given: using reward_fn=default")
