"""launch/dpo.py end to end: the tiny recipe (its main() in this process), bad data reported by line, 2-process ZeRO-3."""

from __future__ import annotations

import json

import pytest

from tests.conftest import accelerate_cmd, run_cmd, run_main


def _metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_launch_tiny_recipe_orpo_with_eval_and_checkpoint(tmp_path, tiny_llama, capfd, monkeypatch):
    out = tmp_path / "run"
    code, stdout, stderr = run_main("dpo", ["--config", "recipes/tiny/dpo.yaml", f"output_dir={out}", "num_train_epochs=1",
                                            "loss_type=orpo", "save_steps=7", "eval_steps=7"], capfd, monkeypatch)
    assert code == 0, (stdout + stderr)[-3000:]
    rows = _metrics(out)
    assert any("eval/rewards/accuracies" in r for r in rows)
    assert all("nll_loss" in r for r in rows if "loss" in r and "eval/loss" not in r)
    assert (out / "checkpoints" / "checkpoint-7" / "COMPLETE").exists()
    assert (out / "model.safetensors").exists() and (out / "config.yaml").exists()


@pytest.mark.slow
def test_launch_reports_bad_row_by_line(tmp_path, tiny_cache, capfd, monkeypatch):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                    '{"prompt": "a", "chosen": "b"}\n')
    code, _, stderr = run_main("dpo", ["--config", "recipes/tiny/dpo.yaml", f"data.path={data}",
                                       f"output_dir={tmp_path / 'o'}"], capfd, monkeypatch)
    assert code == 2
    assert f"{data}:2" in stderr and "rejected" in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_launch_two_process_zero3_with_frozen_reference(tmp_path, tiny_llama, capfd, monkeypatch):
    """(tiny_llama: the model is written once before the ranks start.) The frozen reference is its own ZeRO-3 engine. 2 ranks x 8 pairs must reproduce one process with
    16 pairs: same pairs per step, same metrics, same updates (the metrics of step 3 depend on them).
    The one-process run is launch/dpo.py's main() in this process (conftest.run_main, one thread as in a
    run_cmd subprocess); the ZeRO-3 run is two processes under `accelerate launch`."""
    common = ["--config", "recipes/tiny/dpo.yaml", "max_steps=3", "eval_steps=3", "data.max_examples=64"]
    z3, single = tmp_path / "z3", tmp_path / "single"
    run_cmd(accelerate_cmd("launch/dpo.py", *common, f"output_dir={z3}", "per_device_train_batch_size=8", zero3=True), timeout=400)
    code, stdout, stderr = run_main("dpo", [*common, f"output_dir={single}", "per_device_train_batch_size=16"], capfd, monkeypatch)
    assert code == 0, (stdout + stderr)[-3000:]
    rows = [r for r in _metrics(z3) if "rewards/chosen" in r]
    want = [r for r in _metrics(single) if "rewards/chosen" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # reference == policy at the start
    assert abs(rows[-1]["rewards/chosen"]) > 1e-3  # the sharded policy moved away from the sharded reference
    for got, ref in zip(rows, want):
        for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
            assert got[k] == pytest.approx(ref[k], abs=1e-4), (got["step"], k)
    # a fraction of 8 held-out pairs: allow one pair whose chosen/rejected rewards are a near-tie
    # (within the 1e-4 the two code paths may differ by) to fall the other way
    assert rows[-1]["eval/rewards/accuracies"] == pytest.approx(want[-1]["eval/rewards/accuracies"], abs=0.13)
    assert (z3 / "model.safetensors").exists()
