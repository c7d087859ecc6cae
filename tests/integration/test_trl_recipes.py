"""A TRL recipe file runs unchanged (issue 46): tests/data/trl/ holds two TRL CLI recipes as public recipe
repositories write them (open-r1's config_demo files: ScriptArguments + ModelConfig + the trainer's config, a 7B model
on the hub, push_to_hub on; GRPO with vLLM on, SFT with packing and cosine_with_min_lr). Each plans with --dry-run as
written, touching no hub, and trains on the tiny model with only model_name_or_path and dataset_name overridden
(and use_vllm=false where vLLM is not installed), uploading through huggingface_hub's HfApi, which is replaced here
by a recorder (no hub is reachable)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import launch_module, run_cmd

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/data/trl"
GRPO, SFT = DATA / "grpo_qwen7b.yaml", DATA / "sft_qwen7b.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline"}


class NoHub:
    """An HfApi that fails the test on any use: a dry run asks the hub nothing."""

    def __init__(self, *a, **k):
        raise AssertionError("the dry run built an HfApi")


@pytest.mark.parametrize("trainer,recipe", [("grpo", GRPO), ("sft", SFT)])
def test_a_trl_recipe_plans_unchanged(trainer, recipe, capsys, monkeypatch, tmp_path):
    import huggingface_hub

    from rl.config.vocabulary import reset_warnings

    reset_warnings()  # the notes are once per process: this run's
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(huggingface_hub, "HfApi", NoHub)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launch_module(trainer).main(["--config", str(recipe), "--dry-run"])
    out, err = capsys.readouterr()
    written = yaml.safe_load(recipe.read_text())
    assert "unknown key" not in err and "error" not in err
    assert f"push_to_hub: would upload the model at each checkpoint, and output_dir at the end to " \
           f"https://huggingface.co/<your account>/{written['hub_model_id']} (branch main; hub_strategy every_save); " \
           f"nothing was sent" in out
    assert "policy (trainable)              7615.6M" in out  # Qwen2.5-7B planned from its config, no download
    assert f"data: {written['dataset_name']} is a Hub dataset (a dry run fetches no data)" in out
    plan = yaml.safe_load(out[out.index("config:"):out.index("push_to_hub: would")])
    cfg = plan["config"]
    assert (cfg["model_name"], cfg["model_revision"], cfg["dtype"], cfg["lr_scheduler_type"],
            cfg["lr_scheduler_kwargs"]) == (written["model_name_or_path"], "main", "bfloat16",
                                            "cosine_with_min_lr", {"min_lr_rate": 0.1})
    notes = sorted(line.split("'")[1] for line in err.splitlines() if line.startswith("note: key"))
    if trainer == "grpo":
        assert (cfg["use_vllm"], cfg["max_length"], cfg["eval_strategy"], cfg["system_prompt"][:17]) == (
            True, 512, "steps", "You are a helpful")
        assert notes == ["eval_strategy", "log_level", "vllm_device"]  # log_completions: honoured (completions.jsonl)
    else:
        assert (cfg["packing"], cfg["max_length"], cfg["data"]["name"], cfg["save_strategy"]) == (
            True, 1024, "all", "epoch")
        assert notes == ["dataset_num_proc", "log_level", "use_liger_kernel"]


RUN = """
import json, sys
from types import SimpleNamespace

import huggingface_hub

calls = []


class RecordingApi:
    def __init__(self, token=None):
        calls.append(["HfApi", token])

    def create_repo(self, repo_id, **kw):
        calls.append(["create_repo", repo_id, kw])
        return SimpleNamespace(repo_id="someone/" + repo_id)

    def upload_folder(self, **kw):
        calls.append(["upload_folder", kw["repo_id"], kw.get("path_in_repo"), kw["commit_message"],
                      sorted(p.name for p in __import__("pathlib").Path(kw["folder_path"]).iterdir())])


huggingface_hub.HfApi = RecordingApi
from rl.scripts.train import main

try:
    main(sys.argv[1], sys.argv[2:])
finally:
    json.dump(calls, open("hub_calls.json", "w"))
"""


def _train(trainer: str, argv: list[str], cwd: Path):
    """`python launch/<trainer>.py *argv` in `cwd`, the hub recorded at huggingface_hub.HfApi: (stdout+stderr, the
    HfApi calls)."""
    proc = run_cmd([sys.executable, "-c", RUN, trainer, *argv], env={**OFFLINE, "RL_NO_PROGRESS": "1"}, cwd=cwd)
    return proc.stdout + proc.stderr, json.loads((cwd / "hub_calls.json").read_text())


def _no_vllm() -> list[str]:
    """use_vllm=false where vLLM is not installed (the main venv): the one override beyond the two."""
    return [] if importlib.util.find_spec("vllm") else ["use_vllm=false"]


def _final_metrics(card: Path) -> dict[str, float]:
    rows = card.read_text().split("## Final metrics", 1)[1].split("##", 1)[0]
    return {k.strip(): float(v) for k, v in (line.strip("|").split("|") for line in rows.splitlines()
                                             if line.startswith("| ") and "metric" not in line)}


@pytest.mark.slow
def test_the_trl_grpo_recipe_trains_on_the_tiny_model(tmp_path):
    log, calls = _train("grpo", ["--config", str(GRPO), "model_name_or_path=tiny:qwen2",
                                 f"dataset_name={DATA / 'numina_tiny.jsonl'}", *_no_vllm()], tmp_path)
    out = tmp_path / "data/Qwen2.5-7B-Instruct-GRPO"  # the recipe's output_dir, relative to where it runs
    assert "grpo done: 1 steps" in log and "pushed data/Qwen2.5-7B-Instruct-GRPO to " \
                                           "https://huggingface.co/someone/Qwen2.5-7B-Instruct-GRPO" in log
    assert [c[:2] for c in calls] == [["HfApi", None], ["create_repo", "Qwen2.5-7B-Instruct-GRPO"],
                                      ["upload_folder", "someone/Qwen2.5-7B-Instruct-GRPO"]]  # save_strategy: no
    assert calls[1][2] == {"private": None, "exist_ok": True, "repo_type": "model"}
    assert calls[2][3] == "End of training" and {"README.md", "model.safetensors", "config.yaml"} <= set(calls[2][4])
    metrics = _final_metrics(out / "README.md")
    assert metrics["learning_rate"] == pytest.approx(0.1 * 2e-6)  # cosine_with_min_lr ends at min_lr_rate x peak
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and rows[0]["prompt"][0]["role"] == "system"  # log_completions; system_prompt's chat
    assert {"accuracy_reward", "think_format_reward"} <= set(rows[0])  # TRL's reward functions by name
    assert yaml.safe_load((out / "config.yaml").read_text())["attn_implementation"] == "flash_attention_2"


@pytest.mark.slow
def test_the_trl_sft_recipe_trains_on_the_tiny_model(tmp_path):
    log, calls = _train("sft", ["--config", str(SFT), "model_name_or_path=tiny:qwen2",
                                f"dataset_name={DATA / 'chat'}"], tmp_path)
    out = tmp_path / "data/Qwen2.5-7B-Open-R1-Distill"
    assert "sft done:" in log and "pushed data/Qwen2.5-7B-Open-R1-Distill" in log
    uploads = [c[2:4] for c in calls if c[0] == "upload_folder"]
    # hub_strategy every_save: the model at each epoch's checkpoint (save_strategy: epoch), then output_dir
    assert uploads == [[None, "Training in progress, step 1"], [None, "Training in progress, step 2"],
                       [None, "End of training"]]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-2"]  # save_total_limit: 1
    metrics = _final_metrics(out / "README.md")
    assert metrics["learning_rate"] == pytest.approx(0.1 * 4e-5)  # cosine_with_min_lr's floor after the last step
    assert metrics["epoch"] == 2 and (out / "runs").is_dir()  # report_to: tensorboard
