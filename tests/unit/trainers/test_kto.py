"""KTO trainer: data errors by file:line, config checks, resume equals an uninterrupted run, --help."""

from __future__ import annotations

import json

import pytest

from tests.conftest import LEARN_SEED, learned, run_main


def _cfg(tiny_llama, out, **kw):
    from rl.config.fields import build
    from rl.trainers.kto import KTOConfig

    base = dict(model_name=tiny_llama, output_dir=str(out), report_to=["none"], per_device_train_batch_size=4, learning_rate=1e-3,
                lr_scheduler_type="constant", max_length=32, max_prompt_length=16, dtype="float32", beta=0.5,
                data={"path": "data/tiny/kto.jsonl", "max_examples": 24})
    return build(KTOConfig, {**base, **kw})


def test_bad_label_is_reported_by_line(tmp_path, monkeypatch):
    from rl.errors import ConfigError, DataError
    from rl.trainers.kto import KTOTrainer

    data = tmp_path / "kto.jsonl"
    data.write_text('{"prompt": "a", "completion": "b", "label": true}\n'
                    '{"prompt": "a", "completion": "c", "label": "no"}\n')
    with pytest.raises(DataError, match=f"{data}:2: column 'label' must be true or false"):
        KTOTrainer.load_data(_cfg("x", tmp_path, data={"path": str(data)}))
    data.write_text('{"prompt": "a", "completion": "b", "label": true}\n' * 2)
    with pytest.raises(DataError, match="KTO needs both"):
        KTOTrainer.load_data(_cfg("x", tmp_path, data={"path": str(data)}))
    with pytest.raises(ConfigError, match="at least 2"):
        _cfg("x", tmp_path, per_device_train_batch_size=1)


def test_resume_equals_uninterrupted(tiny_llama, tiny_tokenizer, tmp_path, monkeypatch):
    from rl.data.kto import UnpairedDataset
    from rl.trainers.kto import KTOTrainer

    monkeypatch.chdir(__import__("conftest").ROOT)

    def run(out, max_steps, **kw):
        cfg = _cfg(tiny_llama, out, max_steps=max_steps, **kw)
        records, _ = KTOTrainer.load_data(cfg)
        trainer = KTOTrainer(cfg, tokenizer=tiny_tokenizer)
        hist = trainer.train(UnpairedDataset.from_records(records, tiny_tokenizer, cfg))
        return trainer, hist

    # 24 rows, batch 4: 6 steps per epoch; 8 steps cross an epoch boundary (a reshuffle)
    full, full_hist = run(tmp_path / "full", 8)
    run(tmp_path / "cut", 5, save_steps=5)
    resumed, resumed_hist = run(tmp_path / "cut", 8, resume="auto")
    assert [r["step"] for r in resumed_hist] == [6, 7, 8]
    for a, b in zip(full_hist[5:], resumed_hist):
        for k in ("loss", "kl", "rewards/chosen", "rewards/rejected"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)
    pa = dict(full.pipeline.unwrapped_model.named_parameters())
    diff = max((pa[n] - p).abs().max().item() for n, p in resumed.pipeline.unwrapped_model.named_parameters())
    assert diff < 1e-6, diff


def test_help(capfd, monkeypatch):
    code, stdout, _ = run_main("kto", ["--help"], capfd, monkeypatch)
    assert code == 0
    for key in ("desirable_weight", "undesirable_weight", "beta", "data.label_column", "shuffle"):
        assert key in stdout, key


@pytest.mark.slow
def test_kto_recipe_runs_and_learns(tmp_path, tiny_llama, capfd, monkeypatch):
    out = tmp_path / "run"
    code, stdout, stderr = run_main("kto", ["--config", "recipes/tiny/kto.yaml", f"output_dir={out}", f"seed={LEARN_SEED}"],
                                    capfd, monkeypatch)
    assert code == 0, stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("kl" in r for r in rows if "loss" in r)
    margins = [r["eval/rewards/margins"] for r in rows if "eval/rewards/margins" in r]
    assert learned("kto_eval_margin", margins[-1]) > 0.2
    assert (out / "model.safetensors").exists() and "kto done" in stdout
