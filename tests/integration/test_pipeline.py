"""The README's main job end to end: tiny model -> SFT -> held-out accuracy -> GRPO -> accuracy again."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import LEARN_SEED, learned, run_cmd, run_main

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


# the tiny pipeline cut to a few steps of each stage (seconds in this process)
CHEAP = ["num_sft_examples=64", "eval_num_prompts=4", "sft.per_device_train_batch_size=8", "sft.max_steps=3", "sft.logging_steps=1",
         "grpo.per_device_train_batch_size=8", "grpo.num_generations=4", "grpo.max_steps=2", "grpo.eval_steps=0",
         "grpo.logging_steps=1"]


def _pipeline(out, *extra, capfd, monkeypatch, stop: tuple | None = None):
    """launch/pipeline.py's main() in this process (conftest.run_main); `stop` = (stage, step, signal) raises
    the signal in the run's own thread once that stage's row of that step has passed the non-finite guard,
    so fit()'s handler receives it as it would a Ctrl-C (see test_lifecycle._signal_in_process)."""
    import signal as _signal

    from rl.trainers import base

    real = base.check_finite

    def then_signal(row):
        real(row)
        stage = "grpo" if any(k.startswith("reward") for k in row) else "sft"
        if stop and (stage, row["step"]) == stop[:2]:
            _signal.raise_signal(stop[2])

    monkeypatch.setattr(base, "check_finite", then_signal)
    try:
        return run_main("pipeline", ["--config", "recipes/tiny/pipeline.yaml", *CHEAP, f"output_dir={out}", *extra],
                        capfd, monkeypatch)
    finally:
        monkeypatch.setattr(base, "check_finite", real)


def test_a_stop_in_the_sft_stage_ends_the_pipeline_and_a_rerun_is_refused(tmp_path, capfd, monkeypatch):
    """Ctrl-C during SFT: its checkpoint, exit 130, no GRPO stage on the half-trained model, no summary.
    Rerunning into that output_dir is refused in one line (overwrite=true to replace it); sft.resume=auto
    continues the SFT stage and finishes the pipeline."""
    import signal

    out = tmp_path / "p"
    code, _, err = _pipeline(out, capfd=capfd, monkeypatch=monkeypatch, stop=("sft", 2, signal.SIGINT))
    assert code == 130, err[-3000:]
    assert "pipeline: the sft stage stopped on signal 2" in err and "grpo not run" in err, err[-3000:]
    assert (out / "sft" / "checkpoints" / "checkpoint-2").is_dir()
    # grpo not run: nothing of its run (its output_dir holds the run lock taken when the pipeline started)
    assert not (out / "grpo" / "metrics.jsonl").exists() and not (out / "summary.json").exists() \
        and not (out / "accuracy.png").exists()
    code, _, err = _pipeline(out, capfd=capfd, monkeypatch=monkeypatch)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and lines == [f"error: output_dir={out} holds a previous pipeline run (sft/metrics.jsonl); "
                                   f"pass overwrite=true to replace it, or another output_dir"], err[-3000:]
    assert not (out / "grpo" / "metrics.jsonl").exists()
    code, _, err = _pipeline(out, "sft.resume=auto", capfd=capfd, monkeypatch=monkeypatch)
    assert code == 0, err[-3000:]
    assert "resumed from" in err + _ and json.loads((out / "summary.json").read_text())["sft_steps"] == 3


def test_a_stop_in_the_grpo_stage_leaves_no_summary_and_resumes_to_the_right_one(tmp_path, capfd, monkeypatch):
    """overwrite=true over a finished run removes its summary and plots first; SIGTERM during GRPO then
    exits 143 without a summary (neither the old one nor one of the half-trained model). grpo.resume=auto
    continues GRPO from the finished SFT model without running SFT again, and the summary's SFT accuracy is
    GRPO's step-0 evaluation logged before the stop."""
    import signal

    out = tmp_path / "p"
    out.mkdir()
    (out / "summary.json").write_text('{"sft_accuracy": 0.5}')
    (out / "accuracy.png").write_bytes(b"old")
    code, _, err = _pipeline(out, capfd=capfd, monkeypatch=monkeypatch)
    assert code == 2 and "holds a previous pipeline run (summary.json)" in err, err[-3000:]
    code, _, err = _pipeline(out, "overwrite=true", capfd=capfd, monkeypatch=monkeypatch,
                             stop=("grpo", 1, signal.SIGTERM))
    assert code == 143, err[-3000:]
    assert "pipeline: the grpo stage stopped on signal 15" in err, err[-3000:]
    assert not (out / "summary.json").exists() and not (out / "accuracy.png").exists()
    assert (out / "sft" / "model.safetensors").exists() and not (out / "grpo" / "model.safetensors").exists()
    sft_log = (out / "sft" / "metrics.jsonl").read_bytes()
    code, _, err = _pipeline(out, "grpo.resume=auto", capfd=capfd, monkeypatch=monkeypatch)
    assert code == 0, err[-3000:]
    assert (out / "sft" / "metrics.jsonl").read_bytes() == sft_log  # SFT did not run again
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    step0 = next(r["eval/accuracy"] for r in rows if r["step"] == 0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft_accuracy"] == round(step0, 6) and (out / "grpo" / "model.safetensors").exists()
