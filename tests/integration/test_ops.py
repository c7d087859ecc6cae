"""Operations: dry-run memory estimates (checked against DeepSpeed's estimator), parameter counts of real
architectures from their configs, the rl-train CLI, accelerate configs, and every recipe under recipes/
validating and passing --dry-run with a tiny substitute model."""

from __future__ import annotations

import contextlib
import io
import math
import re
import sys

import pytest
import yaml

from rl.scripts.common import KNOWN_CONFIGS
from rl.scripts.dryrun import (
    ZeroSettings,
    count_parameters,
    dry_run_report,
    frozen_states_bytes,
    load_model_config,
    trainable_states_bytes,
    zero_settings,
)
from tests.conftest import ROOT, launch_module, run_cmd

GiB = 2**30


# ------------------------------------------------------------------------------- memory estimates

def test_trainable_formulas_by_hand():
    # N=1000 params, L=100 largest layer, W=4 GPUs, bf16 (18 bytes per trainable parameter)
    z3 = ZeroSettings(3, False, False, None)
    assert trainable_states_bytes(1000, 100, 4, z3) == 4 * 100 + 18 * 1000 // 4  # 4900
    assert trainable_states_bytes(1000, 100, 4, ZeroSettings(3, True, False, None)) == 400 + 2 * 1000 // 4
    assert trainable_states_bytes(1000, 100, 4, ZeroSettings(3, True, True, None)) == 400
    assert trainable_states_bytes(1000, 100, 4, ZeroSettings(2, False, False, None)) == 2000 + 4500
    assert trainable_states_bytes(1000, 100, 4, ZeroSettings(0, False, False, None)) == 16000
    # LoRA: 10 trainable of 1000, frozen weights at 2 bytes
    assert trainable_states_bytes(1000, 100, 1, ZeroSettings(0, False, False, None), trainable=10) == 160 + 990 * 2
    assert frozen_states_bytes(1000, 100, 4, z3) == 2 * 1000 // 4 + 2 * 100
    assert frozen_states_bytes(1000, 100, 4, ZeroSettings(2, False, False, None)) == 2000


@pytest.mark.parametrize("gpus,nodes", [(8, 1), (8, 2), (1, 1)])
def test_zero3_estimate_matches_deepspeed(gpus, nodes):
    """Our ZeRO-3 figures for Llama-3.1-8B equal DeepSpeed's own estimator, function and printed table."""
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_cold,
    )

    pc = count_parameters(load_model_config("meta-llama/Llama-3.1-8B"))
    world = gpus * nodes
    ours = {
        (False, False): trainable_states_bytes(pc.total, pc.largest_layer, world, ZeroSettings(3, False, False, None)),
        (True, False): trainable_states_bytes(pc.total, pc.largest_layer, world, ZeroSettings(3, True, False, None)),
        (True, True): trainable_states_bytes(pc.total, pc.largest_layer, world, ZeroSettings(3, True, True, None)),
    }
    for (opt_off, param_off), mine in ours.items():
        _, gpu, _ = estimate_zero3_model_states_mem_needs(pc.total, pc.largest_layer, gpus, nodes,
                                                          cpu_offload=opt_off, cpu_offload_params=param_off)
        assert mine == pytest.approx(gpu, abs=2), (opt_off, param_off)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        estimate_zero3_model_states_mem_needs_all_cold(pc.total, pc.largest_layer, gpus, nodes)
    printed = {}
    for line in buf.getvalue().splitlines():
        # e.g. "  179.49GB |   3.83GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1"
        m = re.match(r"\s*([\d.]+)GB \|\s*([\d.]+)GB \| offload_param=(\S+?)\s*, offload_optimizer=(\S+?)\s*, "
                     r"zero_init=1", line)
        if m:
            printed[(m.group(4) != "none", m.group(3) != "none")] = float(m.group(2))
    assert set(printed) == set(ours)
    for k, mine in ours.items():
        assert round(mine / GiB, 2) == pytest.approx(printed[k], abs=0.011), k


def test_zero2_estimate_matches_deepspeed():
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
    )

    pc = count_parameters(load_model_config("Qwen/Qwen2.5-7B"))
    for off in (False, True):
        _, gpu = estimate_zero2_model_states_mem_needs(pc.total, 8, 1, cpu_offload=off)
        assert trainable_states_bytes(pc.total, pc.largest_layer, 8, ZeroSettings(2, off, False, None)) \
            == pytest.approx(gpu, abs=2)


@pytest.mark.parametrize("name,published", [
    ("google/gemma-3-270m", 268.1e6), ("google/gemma-2-2b-it", 2.614e9), ("Qwen/Qwen2.5-0.5B-Instruct", 494.0e6),
    ("Qwen/Qwen2.5-7B", 7.616e9), ("meta-llama/Llama-3.1-8B-Instruct", 8.030e9)])
def test_parameter_counts_of_real_architectures(name, published):
    """Counted on the meta device from the config alone; equal to the model cards' figures."""
    pc = count_parameters(load_model_config(name))
    assert pc.total == pytest.approx(published, rel=2e-3)
    assert pc.largest_layer == KNOWN_CONFIGS[next(k for k in KNOWN_CONFIGS if k in name.lower())]["vocab_size"] * \
        load_model_config(name).hidden_size  # the embedding is the largest layer


def test_counts_match_a_real_tiny_model(tiny_llama):
    """Meta-device totals and LoRA counts equal those of the real model with real peft adapters."""
    from rl.models.loading import apply_lora, load_causal_lm, trainable_fraction

    conf = load_model_config(tiny_llama)
    pc = count_parameters(conf, lora_rank=4)
    model = load_causal_lm(tiny_llama, dtype="float32")
    assert pc.total == sum(p.numel() for p in model.parameters())
    trainable, _ = trainable_fraction(apply_lora(model, rank=4, alpha=8, dropout=0.0))
    assert pc.lora == trainable
    from rl.models.sources import resolve_model_path

    clf_path = resolve_model_path("tiny:llama-classifier")
    clf = load_causal_lm(clf_path, dtype="float32", task="classifier")
    assert count_parameters(load_model_config(clf_path), task="classifier").total == \
        sum(p.numel() for p in clf.parameters())


def test_zero_settings_from_ds_configs(monkeypatch):
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert zero_settings(None).stage == 0
    assert (zero_settings("ds_configs/zero2.json").stage, zero_settings("ds_configs/zero2.json").offload_optimizer) \
        == (2, False)
    z = zero_settings("ds_configs/zero3_offload.json")
    assert (z.stage, z.offload_optimizer, z.offload_param) == (3, True, True)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/zero3.json")
    assert zero_settings(None).stage == 3  # what `accelerate launch --deepspeed_config_file` sets


def test_dry_run_report_table(monkeypatch, capsys):
    from rl.trainers.dpo import DPOConfig

    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = DPOConfig(model_name="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16", per_device_train_batch_size=2,
                    gradient_accumulation_steps=4, deepspeed="ds_configs/zero3.json")
    info = dry_run_report(cfg, 1000, {"policy (trainable)": cfg.model_name, "reference (frozen)": cfg.model_name})
    out = capsys.readouterr().out
    assert info["global_batch"] == 64 and info["zero_stage"] == 3 and info["steps_per_epoch"] == 16  # ceil(1000 / 64): the last step has 40
    pol, ref = info["memory_per_gpu"]
    n, big = 8_030_261_248, 128256 * 4096
    assert pol["gib_per_gpu"] == pytest.approx((4 * big + 18 * n / 8) / GiB, abs=1e-3)
    assert ref["gib_per_gpu"] == pytest.approx((2 * n / 8 + 2 * big) / GiB, abs=1e-3)
    assert "GiB/GPU" in out and "reference (frozen)" in out


# ------------------------------------------------------------------------------------------ rl-train

def test_rl_train_translates_reference_flags():
    from rl.scripts.cli import _schema, translate

    args = translate("ppo", ["llm", "--train", "--model", "google/gemma-3-270m", "--data-path", "p.jsonl",
                             "--project-name", "out", "--rl-kl-coef", "0.2", "--rl-reward-model-path", "rm",
                             "--text-column", "q", "--lr=1e-5", "--epochs", "2", "--batch-size", "4",
                             "--model-ref", "ref", "--max_steps", "3", "lora.rank=8"], _schema("ppo"))
    assert args == ["--model_name", "google/gemma-3-270m", "--data.path", "p.jsonl", "--output_dir", "out",
                    "--rl_kl_coef", "0.2", "--rl_reward_model_path", "rm", "--data.text_column", "q",
                    "--learning_rate", "1e-5", "--num_train_epochs", "2", "--per_device_train_batch_size", "4", "--ref_model", "ref",
                    "--max_steps", "3", "lora.rank=8"]
    dpo = translate("dpo", ["--dpo-beta", "0.3", "--text-column", "good", "--rejected-text-column", "bad",
                            "--prompt-text-column", "q", "--model-ref", "r"], _schema("dpo"))
    assert dpo == ["--beta", "0.3", "--data.chosen_column", "good", "--data.rejected_column", "bad",
                   "--data.prompt_column", "q", "--ref_model", "r"]
    # the translated arguments parse into the schema's fields
    from rl.config.parse import parse_config

    cfg = parse_config(_schema("dpo"), ["--model", "tiny:llama", *dpo])
    assert (cfg.beta, cfg.data.chosen_column, cfg.ref_model) == (0.3, "good", "r")
    with pytest.raises(ValueError, match="--dpo-beta has no meaning for --trainer sft"):
        translate("sft", ["--dpo-beta", "0.1"], _schema("sft"))


@pytest.mark.slow
def test_rl_train_runs_sft(tmp_path, tiny_llama):
    out = tmp_path / "run"
    p = run_cmd([sys.executable, "-m", "rl.scripts.cli", "--trainer", "sft", "--config", "recipes/tiny/sft.yaml",
                 "--model", "tiny:llama", "--data-path", "data/tiny/sft_arith.jsonl", "--project-name", str(out),
                 "--lr", "3e-3", "--batch-size", "16", "--max_steps", "2"], timeout=300)
    assert "sft done" in p.stdout and (out / "model.safetensors").exists()
    bad = __import__("subprocess").run([sys.executable, "-m", "rl.scripts.cli", "--trainer", "nope"], cwd=ROOT,
                                       capture_output=True, text=True)
    assert bad.returncode == 2 and "choose one of sft, reward, dpo, ppo, grpo" in bad.stderr


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    kinds = {"single_gpu": ("NO", 1), "multi_gpu": ("MULTI_GPU", 8), "multi_gpu_zero3": ("DEEPSPEED", 8)}
    for name, (kind, n) in kinds.items():
        c = load_config_from_file(str(ROOT / "configs/accelerate" / f"{name}.yaml"))
        assert (c.distributed_type.value, c.num_processes) == (kind, n)
    ds = load_config_from_file(str(ROOT / "configs/accelerate/multi_gpu_zero3.yaml")).deepspeed_config
    assert (ROOT / ds["deepspeed_config_file"]).is_file()


# --------------------------------------------------------------------------------------- recipes

TINY_FAMILY = {"gemma": "tiny:gemma", "qwen": "tiny:qwen2", "llama": "tiny:llama"}
HEADER = ("Purpose:", "Hardware:", "Command:", "ds_config:", "Override:")
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))


def _trainer_of(text: str, recipe: str) -> str:
    """The launch script of the header command that runs this recipe (a header may show a pipeline,
    e.g. launch/reward.py before launch/ppo.py)."""
    head = text.split("\n\n", 1)[0]
    commands = re.findall(r"launch/(\w+)\.py(.*?)(?=launch/\w+\.py|\Z)", head, re.S)
    assert commands, "the recipe header names no launch/<trainer>.py command"
    return next((t for t, rest in commands if recipe in rest), commands[0][0])


def _tiny_data(trainer: str) -> str | None:
    tiny = ROOT / "recipes/tiny" / f"{trainer}.yaml"
    return (yaml.safe_load(tiny.read_text()).get("data") or {}).get("path") if tiny.exists() else None


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_and_dry_runs(recipe, capsys, monkeypatch):
    text = (ROOT / recipe).read_text()
    head = text.split("\n\n", 1)[0]
    missing = [h for h in HEADER if h not in head]
    assert not missing, f"{recipe}: header lacks {missing} (see design.md: purpose, hardware, command, ds_config, override)"
    trainer = _trainer_of(text, recipe)
    script = ROOT / "launch" / f"{trainer}.py"
    if not script.exists():
        pytest.skip(f"launch/{trainer}.py does not exist yet")
    from rl.config.parse import parse_config
    from rl.scripts.cli import TRAINERS, _schema

    mod = launch_module(trainer)  # the code behind launch/<trainer>.py
    if trainer not in TRAINERS:  # a driver of other launch scripts (launch/pipeline.py): its schema only
        import dataclasses

        schemas = [v for k, v in vars(mod).items() if k.endswith("Config") and dataclasses.is_dataclass(v)
                   and v.__module__ == mod.__name__]
        assert schemas, f"launch/{trainer}.py defines no *Config schema"
        parse_config(schemas[0], ["--config", recipe])
        pytest.skip(f"launch/{trainer}.py is not a trainer (it runs the others): validated, no --dry-run")
    schema = _schema(trainer)
    data = yaml.safe_load(text)
    overrides = ["dry_run=true", "report_to=[jsonl]"]
    # A reward model named by path is trained first (launch/reward.py); stand in a tiny one for it.
    for key in ("reward_model_path", "rl_reward_model_path"):
        if data.get(key) and not (ROOT / str(data[key])).exists():
            from rl.models.sources import resolve_model_path

            overrides.append(f"{key}={resolve_model_path('tiny:llama-classifier')}")
    cfg = parse_config(schema, ["--config", recipe, *overrides[2:]])  # the recipe validates
    if not cfg.model_name.startswith("tiny:"):
        family = next((f for f in TINY_FAMILY if f in cfg.model_name.lower()), "llama")
        overrides.append(f"model_name={TINY_FAMILY[family]}")
        if getattr(cfg, "max_length", 0) > 1024:  # the stand-in's context (rl.models.limits refuses more)
            overrides.append("max_length=1024")
    path = (data.get("data") or {}).get("path")
    if not path and _tiny_data(trainer):  # a Hub id stays: the dry run plans without it (test_first_hour.py)
        overrides.append(f"data.path={_tiny_data(trainer)}")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        mod.main(["--config", recipe, *overrides])
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines()
        pytest.fail(f"{recipe}: --dry-run exited {e.code}: {err[-1] if err else ''}")
    out = capsys.readouterr().out
    assert "world_size: 1" in out and "GiB/GPU" in out, f"{recipe}: the dry run printed no memory table"
    assert re.search(r"policy \(trainable\)|reward model \(trainable\)", out)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit",
                                   "paged_adamw_32bit", "adafactor", "sgd"])
def test_trl_optimizer_names_train_and_unknown_is_exit_2(optim, tmp_path, tiny_llama):
    """`optim` takes HF/TRL's names; each one steps the tiny model on this CPU (bitsandbytes' 8-bit and
    paged optimizers included) and moves its weights; an unknown name is one line listing the choices."""
    from rl.config.fields import build
    from rl.config.parse import parse_config
    from rl.data.sft import tokenize_examples
    from rl.errors import ConfigError
    from rl.trainers.sft import SFTConfig, SFTTrainer

    cfg = build(SFTConfig, {"model_name": tiny_llama, "output_dir": str(tmp_path), "max_steps": 2, "per_device_train_batch_size": 2,
                            "report_to": ["none"], "learning_rate": 1e-2, "optim": optim})
    trainer = SFTTrainer(cfg)
    before = [p.detach().clone() for p in trainer._model.parameters()]
    data = tokenize_examples([{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(4)], trainer.tokenizer, cfg)
    history = trainer.train(data)
    assert len(history) == 2 and all(math.isfinite(r["loss"]) for r in history)
    moved = max((a - b.detach()).abs().max().item() for a, b in zip(before, trainer.pipeline.unwrapped_model.parameters()))
    assert moved > 0, optim
    if optim == "adamw_torch":
        with pytest.raises(ConfigError, match="key 'optim'.*adamw_8bit.*sgd"):
            parse_config(SFTConfig, ["--model_name", "m", "optim=adam"])


def test_dry_run_counts_8bit_optimizer_states():
    """The memory plan: 8-bit AdamW keeps 2 bytes of moments per trainable parameter instead of 8."""
    from rl.scripts.dryrun import ZeroSettings, trainable_states_bytes

    ddp = ZeroSettings(0, False, False, None)
    assert trainable_states_bytes(1000, 100, 1, ddp) == 16000
    assert trainable_states_bytes(1000, 100, 1, ddp, optim="adamw_8bit") == 10000
    assert trainable_states_bytes(1000, 100, 4, ZeroSettings(3, False, False, None), optim="paged_adamw_8bit") == \
        400 + 12 * 1000 // 4
