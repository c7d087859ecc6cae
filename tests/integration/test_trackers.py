"""MLflow and trackio through accelerate's tracker API: a tiny SFT run with `report_to: [<sink>]`, its
metrics read back with the library's own reader and compared with metrics.jsonl. Both are in the dev
extra (pyproject.toml); each test skips where its package is not installed (the one-line error for a
missing sink is tested in tests/integration/test_outputs.py)."""

from __future__ import annotations

import json

import pytest

from rl.config.fields import build
from rl.data.sft import tokenize_examples
from rl.trainers.sft import SFTConfig, SFTTrainer


def _tiny_sft(tiny_llama, out, sink: str) -> list[dict]:
    """Three optimizer steps logged to jsonl and `sink`; the rows of metrics.jsonl."""
    cfg = build(SFTConfig, {"model_name": tiny_llama, "output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": 2,
                            "logging_steps": 1, "report_to": ["jsonl", sink], "run_name": "tiny",
                            "learning_rate": 1e-3, "lora": {"rank": 4}})
    trainer = SFTTrainer(cfg)
    data = tokenize_examples([{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(6)],
                             trainer.tokenizer, cfg)
    trainer.train(data)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_mlflow_holds_what_jsonl_holds(tiny_llama, tmp_path, monkeypatch):
    """With no MLFLOW_TRACKING_URI the run goes to a file store in <output_dir>/mlruns (experiment =
    run_name); every logged loss and learning rate is there at its step, the recipe as parameters."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    rows = _tiny_sft(tiny_llama, out, "mlflow")
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    for key in ("loss", "learning_rate", "num_tokens"):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(history) == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in rows], key
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert run.data.params["lora.rank"] == "4" and run.data.params["max_steps"] == "3"


def test_trackio_holds_what_jsonl_holds(tiny_llama, tmp_path, monkeypatch):
    """trackio logs locally (no network, no Space): project TRACKIO_PROJECT, run = run_name, in its
    SQLite store; read back with trackio's own storage reader."""
    pytest.importorskip("trackio")
    import trackio.sqlite_storage as storage

    # trackio reads TRACKIO_DIR when it is first imported: point both the variable and the module at tmp_path
    store = tmp_path / "trackio"
    store.mkdir()
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    monkeypatch.setattr(storage, "TRACKIO_DIR", store)
    monkeypatch.setenv("TRACKIO_PROJECT", "rl-test")
    rows = _tiny_sft(tiny_llama, tmp_path / "run", "trackio")
    logged = storage.SQLiteStorage.get_logs("rl-test", "tiny")
    assert [(r["step"], r["loss"]) for r in logged] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert [r["learning_rate"] for r in logged] == pytest.approx([r["learning_rate"] for r in rows], rel=1e-6)
    assert "__time" not in logged[0]  # our wall-clock column stays out: trackio reserves `time`
    assert storage.SQLiteStorage.get_run_config("rl-test", "tiny")["lora.rank"] == 4


def test_an_unreachable_mlflow_server_is_one_line(tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI naming a server that is not there: one RunError naming the sink and the fix, in
    seconds (MLflow's own retries would take minutes), not a traceback at start."""
    from rl.engine.tracking import Tracker
    from rl.errors import RunError
    from tests.conftest import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RunError, match=r"report_to=mlflow: the tracker could not start .*MLFLOW_TRACKING_URI") as e:
        Tracker(tmp_path, ["jsonl", "mlflow"], "run", {"learning_rate": 1e-3}, 2)
    assert "\n" not in str(e.value)
