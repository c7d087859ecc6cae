"""launch/reward.py end to end: single process with the reference CLI's column flags, bad rows,
and one 2-process DeepSpeed ZeRO-3 run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, accelerate_cmd, run_cmd

pytestmark = pytest.mark.slow


def _renamed_data(tmp_path, n=64):
    rows = [json.loads(line) for line in (ROOT / "data/tiny/reward_pairs.jsonl").read_text().splitlines()[:n]]
    path = tmp_path / "renamed.jsonl"
    path.write_text("".join(json.dumps({"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]}) + "\n"
                            for r in rows))
    return path


def test_launch_reward_with_reference_column_flags(tiny_cache, tmp_path):
    from rl.models.reward import load_reward_model

    out = tmp_path / "rm"
    proc = run_cmd([sys.executable, "launch/reward.py", "--config", "recipes/tiny/reward.yaml",
                    "--data.path", str(_renamed_data(tmp_path)), "--prompt-text-column", "question",
                    "--text-column", "good", "--rejected-text-column", "bad", f"output_dir={out}",
                    "max_steps=3", "report_to=[jsonl]"], env={"RL_NO_PROGRESS": "1"}, timeout=300)
    assert "reward done" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert any("eval/accuracy" in r for r in rows)
    scores = load_reward_model(out).score(["xy: ab good cd", "xy: ab bad cd"])
    assert scores.shape == (2,)


def test_launch_reward_reports_bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{"prompt": "q", "chosen": "x", "rejected": "x"}\n'
                    '{"prompt": "q", "rejected": "b"}\n')
    proc = subprocess.run([sys.executable, "launch/reward.py", "--config", "recipes/tiny/reward.yaml",
                           "--data.path", str(path), f"output_dir={tmp_path / 'out'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{path}:2: 'chosen' and 'rejected' are identical" in proc.stderr
    assert f"{path}:3: missing field 'chosen'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_launch_reward_zero3_two_processes(tiny_cache, tmp_path):
    from rl.models.reward import load_reward_model

    out = tmp_path / "z3"
    proc = run_cmd(accelerate_cmd("launch/reward.py", "--config", "recipes/tiny/reward.yaml", f"output_dir={out}",
                                  "max_steps=3", "data.max_examples=64", "report_to=[jsonl]", zero3=True),
                   env={"RL_NO_PROGRESS": "1"}, timeout=400)
    assert "reward done" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "loss" in r]) == 3
    # The gathered weights were written whole (not ZeRO-3 shards) and score like any other model.
    scores = load_reward_model(out).score(["xy: ab good cd", "xy: ab bad cd"])
    assert scores.shape == (2,) and bool(scores.isfinite().all())
