"""recipes/tiny/simpo.yaml through launch/dpo.py's main, in this process: reference-free, and it learns."""

from __future__ import annotations

import json

import pytest

from tests.conftest import LEARN_SEED, learned, run_main


@pytest.mark.slow
def test_simpo_recipe_runs_and_learns(tmp_path, tiny_llama, capfd, monkeypatch):
    out = tmp_path / "run"
    code, stdout, stderr = run_main("dpo", ["--config", "recipes/tiny/simpo.yaml", f"output_dir={out}", f"seed={LEARN_SEED}"],
                                    capfd, monkeypatch)
    assert code == 0, stderr[-2000:]
    assert "loss simpo, reference none" in stdout + stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"]
    acc = [r["eval/rewards/accuracies"] for r in rows if "eval/rewards/accuracies" in r]
    assert learned("simpo_eval_accuracy", acc[-1]) >= 0.6
    assert (out / "model.safetensors").exists() and (out / "config.yaml").exists()


def test_simpo_help_lists_gamma(capfd, monkeypatch):
    code, stdout, _ = run_main("dpo", ["--help"], capfd, monkeypatch)
    assert code == 0 and "simpo_gamma" in stdout and "simpo" in stdout
