"""The README's main job end to end: tiny model -> SFT -> held-out accuracy -> GRPO -> accuracy again.

"It learns": GRPO must raise held-out exact match by at least 15 points over its SFT starting point
(the recipe's 350 SFT / 40 GRPO steps are cut to 300 / 20 here to keep the suite short)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT, run_cmd


@pytest.mark.slow
def test_tiny_pipeline_raises_heldout_accuracy(tmp_path):
    out = tmp_path / "pipeline"
    proc = run_cmd([sys.executable, "launch/pipeline.py", "--config", "recipes/tiny/pipeline.yaml",
                    f"output_dir={out}", "sft.max_steps=300", "grpo.max_steps=20", "min_improvement=0.15"],
                   timeout=900, env={"RL_NO_PROGRESS": "1"})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_problems"] == 200
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= 0.15, summary
    assert "held-out exact match (200 problems): SFT" in proc.stdout
    for plot in ("accuracy.png", "sft/metrics.png", "grpo/metrics.png"):
        assert (out / plot).stat().st_size > 0
    assert (out / "grpo" / "model.safetensors").exists()


def test_pipeline_bad_key_fails_fast(tmp_path):
    from rl.config import ConfigError

    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import pipeline
    finally:
        sys.path.pop(0)
    cfg = pipeline.PipelineConfig(grpo={"num_generation": 8})
    with pytest.raises(ConfigError, match="num_generation"):
        pipeline.stage_configs(cfg, "m", tmp_path / "sft", tmp_path / "grpo")
    with pytest.raises(ValueError, match="teacher_error_rate"):
        pipeline.sloppy_teacher([{"prompt": "1+1=", "completion": "2"}], 1.5, 0)
    noisy = pipeline.sloppy_teacher([{"prompt": "1+1=", "completion": "2"}] * 1000, 0.7, 0)
    assert 600 < sum(r["completion"] == "3" for r in noisy) < 800
