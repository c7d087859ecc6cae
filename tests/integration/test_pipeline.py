"""The README's main job end to end: tiny model -> SFT -> held-out accuracy -> GRPO -> accuracy again."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import LEARN_SEED, learned, run_cmd

MIN_GAIN = 0.10


@pytest.mark.slow
def test_tiny_pipeline_raises_heldout_accuracy(tmp_path):
    """It learns: GRPO raises held-out exact match (200 problems) by at least MIN_GAIN over its SFT
    starting point, with the recipe as the README runs it (350 SFT / 40 GRPO steps, ~17 s).

    The gain depends on the CPU's float kernels, not only on the seed: the same seed gave +45 points
    here, +49.5 on another machine, and +20.5 with AVX2 kernels forced. Cutting GRPO to 20 steps (as
    this test once did) gave between -0.5 and +42 points: no threshold holds there. Spread of the full
    recipe by bench/learning_spread.py over seeds 0-3 x {2 threads, 1 thread, AVX2 kernels}: +20.5 to
    +77.0 points (median +60) with the former Gumbel-max sampler. With the inverse-CDF sampler
    (2026-12-02, 1 thread, seeds 0-7): +42, +55.5, +58, +2, +65.5, +72.5, +84.5, +57 points: seed 3
    stalls (SFT 37% -> GRPO 39%, its reward flat at ~0.4 over the 40 steps), so one run in eight falls
    under the bar: a known risk of this test, which the CI's seed 0 (+42) does not meet."""
    out = tmp_path / "pipeline"
    proc = run_cmd([sys.executable, "launch/pipeline.py", "--config", "recipes/tiny/pipeline.yaml",
                    f"output_dir={out}", f"seed={LEARN_SEED}"], timeout=900, env={"RL_NO_PROGRESS": "1"})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_problems"] == 200
    assert learned("pipeline_gain", summary["grpo_accuracy"] - summary["sft_accuracy"]) >= MIN_GAIN, summary
    assert "held-out exact match (200 problems): SFT" in proc.stdout
    for plot in ("accuracy.png", "sft/metrics.png", "grpo/metrics.png"):
        assert (out / plot).stat().st_size > 0
    assert (out / "grpo" / "model.safetensors").exists()
    for stage in ("sft", "grpo"):  # each stage's model card names its trainer and final metrics
        card = (out / stage / "README.md").read_text()
        assert f"**{stage}** trainer" in card and "## Final metrics" in card
    # launch/eval.py on the GRPO run and the shipped held-out file reproduces the main job's figure: it
    # evaluates through the run's own environment (prompts "219+2=", its answer check and lengths)
    ev = run_cmd([sys.executable, "launch/eval.py", "--model", str(out / "grpo"), "--data", "data/tiny/math_test.jsonl"])
    n = round(summary["grpo_accuracy"] * 200)
    assert f"accuracy {summary['grpo_accuracy']:.3f} ({n}/200)" in ev.stdout, (ev.stdout, summary)
    assert "Loading weights" not in ev.stdout + ev.stderr  # transformers' loading bar stays hidden


def test_pipeline_bad_key_fails_fast(tmp_path):
    from rl.errors import ConfigError
    from rl.scripts import pipeline  # the code behind launch/pipeline.py
    cfg = pipeline.PipelineConfig(grpo={"num_generation": 8})
    with pytest.raises(ConfigError, match="num_generation"):
        pipeline.stage_configs(cfg, "m", tmp_path / "sft", tmp_path / "grpo")
    with pytest.raises(ValueError, match="teacher_error_rate"):
        pipeline.sloppy_teacher([{"prompt": "1+1=", "completion": "2"}], 1.5, 0)
    noisy = pipeline.sloppy_teacher([{"prompt": "1+1=", "completion": "2"}] * 1000, 0.7, 0)
    assert 600 < sum(r["completion"] == "3" for r in noisy) < 800
