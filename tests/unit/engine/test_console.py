"""The console line of a logging step (rl.engine.console, printed by rl.engine.tracking.Tracker): one line per
logged row, the trainer's key figures by TRL's names in fixed columns, learning rate, tokens/s, elapsed and ETA;
`quiet` silences it and nothing else."""

from __future__ import annotations

import json

from rl.config.fields import build
from rl.config.parse import split_argv
from rl.engine.console import choose_columns, clock, console_line, value_text
from rl.engine.tracking import Tracker
from rl.trainers.grpo_config import GRPOConfig


def test_columns_are_the_trainers_key_figures_by_trl_names():
    grpo = {"loss": 0.1, "reward": 0.5, "reward_std": 0.2, "kl": 0.01, "grad_norm": 1.0, "learning_rate": 1e-3,
            "completions/mean_length": 5.0}
    assert choose_columns(grpo) == ["loss", "reward", "reward_std", "kl", "grad_norm"]
    dpo = {"loss": 0.69, "rewards/accuracies": 0.5, "rewards/margins": 0.01, "rewards/chosen": 0.0, "grad_norm": 2.0}
    assert choose_columns(dpo) == ["loss", "rewards/accuracies", "rewards/margins", "grad_norm"]
    ppo = {"loss/policy": 0.1, "loss/value": 0.2, "objective/scores": 0.3, "objective/kl": 0.4, "kl_coef": 0.05,
           "grad_norm": 1.0}
    # at most MAX_FIGURES (6): the gradient norm is the first to go
    assert choose_columns(ppo) == ["loss/policy", "loss/value", "objective/scores", "objective/kl", "kl_coef",
                                   "grad_norm"]
    assert choose_columns({"eval/accuracy": 0.1}) == []


def test_a_line_has_fixed_columns_and_the_figures_of_its_row():
    cols = ["loss", "reward"]
    a = console_line(2, 10, {"loss": 0.5, "reward": 0.25, "learning_rate": 1e-3, "train_tokens_per_second": 1234.4},
                     cols, 12.0, 48.0)
    b = console_line(10, 10, {"loss": -12.3456, "reward": 1e-5, "learning_rate": 5e-6,
                              "train_tokens_per_second": 98765.0, "eval/accuracy": 0.75, "eval/num_prompts": 50},
                     cols, 3725.0, 0.0)
    assert a == ("step  2/10 | loss    0.5000 | reward    0.2500 | learning_rate 1.00e-03 | tokens/s   1,234 | "
                 "elapsed 0:00:12 | eta 0:00:48")
    assert b.startswith("step 10/10 | loss  -12.3456 | reward  1.00e-05 | learning_rate 5.00e-06 | tokens/s  98,765 | "
                        "elapsed 1:02:05 | eta 0:00:00 | eval/accuracy 0.7500")
    assert "num_prompts" not in b  # counts are not figures
    # every fixed column starts at the same character on both lines
    assert [i for i, c in enumerate(a) if c == "|"] == [i for i, c in enumerate(b) if c == "|"][:6]


def test_missing_and_non_finite_values_keep_their_column():
    assert value_text("loss", None) == "        -" and value_text("loss", "nan") == "      nan"
    assert value_text("loss", float("inf")) == "      inf" and len(value_text("loss", 123456.0)) == 9
    assert clock(None) == "-" and clock(59.6) == "0:01:00"
    line = console_line(3, None, {"loss": 1.0}, ["loss", "reward"], 1.0, None)
    assert line == "step 3/? | loss    1.0000 | reward         - | tokens/s       - | elapsed 0:00:01 | eta -"


def test_the_evaluation_before_training_has_a_line_of_its_own():
    line = console_line(0, 40, {"eval/accuracy": 0.2, "eval/reward": 0.3, "eval/mean_length": 5.0}, [], 0.4, None)
    assert line == "step  0/40 | elapsed 0:00:00 | eta - | eval/accuracy 0.2000 | eval/reward 0.3000"


def test_tracker_prints_one_line_per_logged_row_unless_quiet(tmp_path, capsys):
    t = Tracker(tmp_path / "a", config={"quiet": False}, total_steps=4)
    t.set_total(4, done=0)
    t.log(0, {"eval/accuracy": 0.5})
    t.log(2, {"loss": 1.0, "reward": 0.5, "learning_rate": 1e-3, "train_tokens_per_second": 10.0})
    t.log(4, {"loss": 0.5, "learning_rate": 1e-3})  # a figure missing in a later row keeps its column
    t.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 0/4", "step 2/4", "step 4/4"], lines
    assert "reward    0.5000" in lines[1] and "reward         -" in lines[2]
    rows = [json.loads(r) for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4]  # the sinks are the same with or without the console
    quiet = Tracker(tmp_path / "b", config={"quiet": True}, total_steps=4)
    quiet.log(1, {"loss": 1.0})
    quiet.close()
    assert capsys.readouterr().out == "" and (tmp_path / "b" / "metrics.jsonl").read_text().count("\n") == 1
    rank1 = Tracker(tmp_path / "c", total_steps=4, is_main=False)  # only the main process prints
    rank1.log(1, {"loss": 1.0})
    assert capsys.readouterr().out == ""


def test_eta_counts_from_the_resumed_step(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("rl.engine.tracking.time.time", lambda: now[0])
    t = Tracker(tmp_path, total_steps=100, console=True)
    t.set_total(100, done=60)  # resumed at step 60
    now[0] += 20.0  # 10 steps in 20 s: 2 s a step, 30 steps left
    line = t.console_text(70, {"loss": 1.0})
    assert "elapsed 0:00:20 | eta 0:01:00" in line, line
    t.close()


def test_quiet_is_a_flag_of_every_trainer():
    _, overrides, _ = split_argv(GRPOConfig, ["--quiet"])
    assert overrides == {"quiet": True}
    assert build(GRPOConfig, {"model_name": "tiny:llama", "env_type": "math", **overrides}).quiet is True
