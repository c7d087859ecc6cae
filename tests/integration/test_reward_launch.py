"""launch/reward.py end to end: single process with the reference CLI's column flags, bad rows,
and a 2-process DeepSpeed ZeRO-3 run on CPU (a short last step equals one process's; the gathered weights score)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, accelerate_cmd, run_cmd, run_main

pytestmark = pytest.mark.slow


def _renamed_data(tmp_path, n=64):
    rows = [json.loads(line) for line in (ROOT / "data/tiny/reward_pairs.jsonl").read_text().splitlines()[:n]]
    path = tmp_path / "renamed.jsonl"
    path.write_text("".join(json.dumps({"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]}) + "\n"
                            for r in rows))
    return path


def test_launch_reward_with_reference_column_flags(tiny_cache, tmp_path, capfd, monkeypatch):
    """launch/reward.py's main() in this process (conftest.run_main: a process start-up fewer; the flags are
    parsed by the same code a subprocess runs)."""
    from rl.models.reward import load_reward_model

    out = tmp_path / "rm"
    code, stdout, stderr = run_main("reward", [
        "--config", "recipes/tiny/reward.yaml", "--data.path", str(_renamed_data(tmp_path)), "--prompt-text-column",
        "question", "--text-column", "good", "--rejected-text-column", "bad", f"output_dir={out}", "max_steps=3",
        "report_to=[jsonl]"], capfd, monkeypatch)
    assert code == 0 and "reward done" in stdout, (stdout + stderr)[-3000:]
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


def test_short_last_step_two_processes_match_one(tiny_cache, tmp_path, capfd, monkeypatch):
    """19 pairs, global batch 16: a step of 16 and one of 3 per epoch, never padded with repeated pairs.
    Under 2 ZeRO-3 processes x 2 micro-batches of 4 the short step gives rank 0 [0], [2] and rank 1 [1]
    and an empty micro-batch (a zero-weight dummy forward); the loss curve equals one process's (8 x 2)
    to 1e-5. The one-process run is the launch script's main() in this process (conftest.run_main). The
    model is a saved tiny classifier: a random score head is initialised differently under ZeRO-3's
    partitioned init than in one process, a saved one is the same in both. The ZeRO-3 run also proves
    what the former test_launch_reward_zero3_two_processes did: it finishes ("reward done"), and the
    gathered weights are written whole (not ZeRO-3 shards) and score like any other model."""
    from rl.models.reward import load_reward_model
    from rl.models.tiny import write_tiny_model
    from tests.conftest import run_main

    model = write_tiny_model(tiny_cache / "llama-classifier", family="llama", task="classifier")
    common = ["--config", "recipes/tiny/reward.yaml", f"model_name={model}", "data.max_examples=19", "data.eval_fraction=0", "num_train_epochs=2",
              "gradient_accumulation_steps=2", "logging_steps=1", "report_to=[jsonl]"]
    one, two = tmp_path / "one", tmp_path / "two"
    code, stdout, stderr = run_main("reward", [*common, "per_device_train_batch_size=8", f"output_dir={one}"], capfd, monkeypatch)
    assert code == 0, (stdout + stderr)[-3000:]
    assert "the last step of each epoch trains on 3" in stdout + stderr
    proc = run_cmd(accelerate_cmd("launch/reward.py", *common, "per_device_train_batch_size=4", f"output_dir={two}", zero3=True),
                   env={"RL_NO_PROGRESS": "1"}, timeout=400)
    assert "reward done" in proc.stdout and "2 processes" in proc.stdout + proc.stderr, proc.stdout[-3000:]

    def rows(out):
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    a, b = rows(one), rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for k, tol in (("loss", 1e-5), ("accuracy", 1e-5), ("margin", 1e-4), ("mean_reward", 1e-4)):
        assert max(abs(x[k] - y[k]) for x, y in zip(a, b)) < tol, (k, a, b)
    assert [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]  # the same pairs, none twice
    scores = load_reward_model(two).score(["xy: ab good cd", "xy: ab bad cd"])
    assert scores.shape == (2,) and bool(scores.isfinite().all())
