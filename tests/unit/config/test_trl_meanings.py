"""TRL's keys with TRL's meanings (a TRL recipe file runs unchanged, docs/coming-from-trl.md): the flat ModelConfig /
ScriptArguments keys reach their sections through the one alias table, value aliases (bf16, scale_rewards, ...),
the cadence strategies and fractions, transformers' schedules, and the one-line errors of issue 49."""

import dataclasses
import math
import os

import pytest
import torch

from rl.config.fields import build
from rl.config.parse import field_type, parse_config
from rl.config.plan import cadence
from rl.config.vocabulary import reset_warnings
from rl.engine.optim import build_optimizer, build_scheduler, optimizer_arguments, warmup_count
from rl.errors import ConfigError
from rl.models.reward_config import RewardModelConfig
from rl.trainers.dpo import DPOConfig
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.sft import SFTConfig

# ------------------------------------------------------------------------------------- names and values


def test_trls_flat_model_and_data_keys_reach_their_sections(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: org/m\nuse_peft: true\nlora_r: 8\nlora_alpha: 16\nlora_target_modules: "
                      "[q_proj, v_proj]\nlora_modules_to_save: [lm_head]\nuse_rslora: true\ndataset_name: org/ds\n"
                      "dataset_config: main\ndataset_train_split: train_sft\ndataset_test_split: test_sft\n"
                      "dataset_text_field: content\ntorch_dtype: bfloat16\nmax_seq_length: 2048\n")
    cfg = parse_config(SFTConfig, ["--config", str(recipe), "lora_r=4"])  # any name on the command line wins
    assert (cfg.model_name, cfg.dtype, cfg.max_length) == ("org/m", "bfloat16", 2048)
    assert dataclasses.asdict(cfg.lora) == {"enabled": True, "rank": 4, "alpha": 16, "dropout": 0.05,
                                            "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"],
                                            "target_parameters": None, "use_rslora": True, "use_dora": False}
    d = cfg.data
    assert (d.path, d.name, d.split, d.eval_split, d.text_column) == ("org/ds", "main", "train_sft", "test_sft",
                                                                      "content")
    assert (cfg.lora_r, cfg.dataset_name) == (4, "org/ds")  # TRL's names read as attributes
    cfg.lora_r = 32
    assert cfg.lora.rank == 32
    assert field_type(SFTConfig, "use_peft") is bool  # a bare --use_peft on the command line is true
    assert parse_config(SFTConfig, ["--model_name_or_path", "m", "--use_peft"]).lora.enabled
    with pytest.raises(ConfigError, match="keys 'lora_r' and 'lora.rank' are the same setting with different values"):
        parse_config(SFTConfig, ["model_name=m", "lora.rank=4", "lora_r=5"])
    with pytest.raises(ConfigError, match="key 'lora_r' .lora.rank. must be at least 1, got 0"):
        parse_config(SFTConfig, ["model_name=m", "lora_r=0"])


def test_the_reference_reward_configs_flat_lora_names_are_the_same_table():
    cfg = RewardModelConfig(use_lora=False, lora_rank=4)
    assert (cfg.lora.enabled, cfg.lora.rank, cfg.lora.alpha, cfg.use_lora) == (False, 4, 16, False)  # others: defaults
    again = dataclasses.replace(cfg, use_lora=True, temperature=2.0)  # replace(): the alias is the change
    assert (again.lora.enabled, again.lora.rank, again.reward_temperature) == (True, 4, 2.0)
    assert RewardModelConfig.from_saved(cfg.model_fields()).lora == cfg.lora


@pytest.mark.parametrize("extra,dtype", [({"bf16": True}, "bfloat16"), ({"bf16": None}, "auto"), ({"bf16": False},
                                         "float32"), ({"fp16": True}, "float16"), ({"fp16": False, "bf16": None},
                                                                                   "auto"),
                                         ({"bf16": True, "torch_dtype": "bfloat16"}, "bfloat16")])
def test_trls_precision_flags(extra, dtype):
    """bf16 with no value is "not set" (TRL then means bf16 unless fp16; dtype auto means bf16 where the GPU has it)."""
    assert build(SFTConfig, {"model_name": "m", **extra}).dtype == dtype


def test_value_aliases_of_trls_script_and_trainer_keys(tmp_path, monkeypatch):
    g = build(GRPOConfig, {"model_name": "m", "per_device_train_batch_size": 8, "scale_rewards": "batch",
                           "max_steps": -1, "resume_from_checkpoint": True, "use_cpu": True,
                           "dataset_configs": ["all"]})
    assert (g.advantage_estimator, g.max_steps, g.resume, g.device, g.data.name) == ("grpo_batch", None, "auto",
                                                                                     "cpu", "all")
    assert build(GRPOConfig, {"model_name": "m", "scale_rewards": False}).advantage_estimator == "dr_grpo"
    with pytest.raises(ConfigError, match="key 'dataset_configs' has value .'a', 'b'., expected a list of one"):
        build(SFTConfig, {"model_name": "m", "dataset_configs": ["a", "b"]})
    recipe = tmp_path / "r.yaml"  # TRL's CLI sets a recipe's env: mapping as environment variables
    recipe.write_text("model_name: m\nenv:\n  RL_TEST_TRL_ENV: offline\n")
    monkeypatch.delenv("RL_TEST_TRL_ENV", raising=False)
    parse_config(SFTConfig, ["--config", str(recipe)])
    assert os.environ["RL_TEST_TRL_ENV"] == "offline"
    monkeypatch.delenv("RL_TEST_TRL_ENV")


def test_grpo_batch_is_trls_scale_rewards_batch():
    from rl.algos.advantages import compute_advantages
    from rl.trainers.rewards import combine_rewards
    from tests.unit.trainers.test_grpo import _trl_advantages

    per_func = torch.randint(0, 4, (16, 1), generator=torch.Generator().manual_seed(0)).float()
    want, _ = _trl_advantages(per_func, torch.ones(1), 4, "batch")
    torch.testing.assert_close(compute_advantages(combine_rewards(per_func, [1.0]), 4, "grpo_batch"), want)


def test_an_eval_strategy_evaluates_the_test_split_of_the_dataset_as_trls_scripts():
    cfg = build(SFTConfig, {"model_name": "m", "dataset_name": "org/ds", "dataset_test_split": "val",
                            "eval_strategy": "steps"})
    assert (cfg.data.eval_path, cfg.data.eval_split) == ("org/ds", "val")
    assert build(SFTConfig, {"model_name": "m", "dataset_name": "a.jsonl", "eval_strategy": "steps"}).data.eval_path \
        is None  # a single file has no test split
    assert build(SFTConfig, {"model_name": "m", "dataset_name": "org/ds"}).data.eval_path is None


def test_online_lengths_from_trls_keys():
    g = build(GRPOConfig, {"model_name": "m", "max_prompt_length": 100, "max_completion_length": 30})
    assert (g.max_length, g.prompt_budget) == (130, 100)
    g = build(GRPOConfig, {"model_name": "m", "max_completion_length": 1024})  # TRL's GRPO has no max_length
    assert (g.max_length, g.prompt_budget) == (1536, 512)


def test_a_trl_list_of_one_value_is_that_value():
    assert DPOConfig(model_name="m", loss_type=["ipo"]).loss_type == "ipo"
    with pytest.raises(ConfigError, match="key 'loss_type' has 2 values .'sigmoid', 'ipo'.: one preference loss"):
        DPOConfig(model_name="m", loss_type=["sigmoid", "ipo"])


# ------------------------------------------------------------------------------------- issue 49's errors


@pytest.mark.parametrize("argv,message", [
    (["loss_type=grpoo"], "key 'loss_type' has unknown value 'grpoo' (did you mean grpo?); choose one of: ppo,"),
    (["scale_reward=group"], "unknown key 'scale_reward' (did you mean scale_rewards (advantage_estimator)?)"),
    (["adam_beta=0.9"], "unknown key 'adam_beta' (did you mean adam_beta2, adam_beta1?)"),
    (["lora_rnk=3"], "unknown key 'lora_rnk' (did you mean lora.rank?)"),
    (["max_new_tokens=x"], "key 'max_new_tokens' has value 'x', expected int"),
    (["bf16=maybe"], "key 'bf16' has value 'maybe', expected bool (true or false)"),
])
def test_errors_name_the_key_as_typed_and_propose_what_it_is_here(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(GRPOConfig, ["model_name=m", *argv])
    assert message in str(e.value) and "\n" not in str(e.value)
    # what issue 49 saw proposed: a reward weight for scale_rewards, dpo_beta for adam_beta1; both are keys now
    assert build(GRPOConfig, {"model_name": "m", "adam_beta1": 0.8, "scale_rewards": "group"}).adam_beta1 == 0.8


# ------------------------------------------------------------------------------------- cadence and schedule


def _cfg(**kw):
    base = dict(num_train_epochs=2, logging_strategy="steps", logging_steps=1, logging_first_step=False,
                eval_strategy=None, eval_steps=0, eval_on_start=False, eval_delay=0, save_strategy=None, save_steps=0)
    return type("C", (), {**base, **kw})()


def test_cadence_reads_trls_strategies_and_fractions():
    assert cadence(_cfg(logging_steps=0.25, eval_steps=0.5, save_steps=0.1), 40) == cadence(
        _cfg(logging_steps=10, eval_steps=20, save_steps=4), 40)  # below 1: a fraction of the run, ceil
    c = cadence(_cfg(eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch"), 40, steps_per_epoch=15)
    assert (c.eval, c.save, c.logging) == (15, 15, 15)
    assert cadence(_cfg(eval_strategy="epoch"), 40).eval == 20  # no epoch size known: total / num_train_epochs
    c = cadence(_cfg(eval_strategy="steps", logging_steps=5, eval_delay=12), 40)  # eval_steps unset: logging_steps
    assert [s for s in range(1, 41) if c.eval_at(s, 40)] == [15, 20, 25, 30, 35, 40]
    off = cadence(_cfg(eval_strategy="no", save_strategy="no", save_steps=5, logging_strategy="no"), 40)
    assert not any(off.eval_at(s, 40) or off.save_at(s) or off.log_at(s, 40) for s in range(1, 41))
    first = cadence(_cfg(logging_steps=10, logging_first_step=True), 40)
    assert [s for s in range(1, 41) if first.log_at(s, 40)] == [1, 10, 20, 30, 40]
    with pytest.raises(ConfigError, match="key 'save_steps' must be a whole number of steps, or a fraction"):
        SFTConfig(model_name="m", save_steps=2.5)


def test_warmup_and_transformers_schedules():
    assert (warmup_count(100, 0.0, 0.05), warmup_count(100, 0.1, 50), warmup_count(100, 0.0, 7)) == (5, 10, 7)
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, 1e-3, optim="adamw_torch", betas=(0.8, 0.9), eps=1e-6, optim_args="amsgrad=True")
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6 and opt.defaults["amsgrad"] is True
    assert optimizer_arguments("foreach=False, maximize=False") == {"foreach": False, "maximize": False}
    sched = build_scheduler(opt, "cosine_with_min_lr", 10, warmup_steps=0.2, kwargs={"min_lr_rate": 0.1})
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3)  # 2 warmup steps (ceil 0.2 x 10), then the peak
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # ends at min_lr_rate x peak, not 0
    with pytest.raises(ConfigError, match="key 'lr_scheduler_kwargs'"):
        build_scheduler(opt, "cosine_with_min_lr", 10)  # transformers wants min_lr or min_lr_rate


def test_constant_with_a_warmup_says_transformers_has_none(capsys):
    reset_warnings()
    SFTConfig(model_name="m", lr_scheduler_type="constant", warmup_ratio=0.1)
    assert "note: key 'warmup_ratio' is accepted and ignored (lr_scheduler_type=constant has no warmup" in \
        capsys.readouterr().err


# ------------------------------------------------------------------------------------- loading keys


def test_model_loading_keys_reach_from_pretrained(monkeypatch):
    """model_revision, model_init_kwargs, the 4-bit keys and gradient_checkpointing_kwargs as transformers receives
    them (from_pretrained recorded; no weights loaded)."""
    import transformers

    from rl.models import loading

    seen = {}

    class Stop(Exception):
        pass

    def fake(path, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)
    cfg = build(SFTConfig, {"model_name": "org/model", "model_revision": "v2", "model_init_kwargs": {"use_cache": False,
                            "dtype": "float16"}, "load_in_4bit": True, "use_peft": True, "bnb_4bit_quant_type": "fp4",
                            "use_bnb_nested_quant": True, "attn_implementation": "eager"})
    with pytest.raises(Stop):
        loading.load_trainable_policy(cfg)
    q = seen["quantization_config"]
    assert (seen["revision"], seen["use_cache"], seen["dtype"], seen["attn_implementation"]) == (
        "v2", False, torch.float32, "eager")  # the trained weights stay fp32: dtype is the dtype key's
    assert (q.load_in_4bit, q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant) == (True, "fp4", True)
    with pytest.raises(ConfigError, match="load_in_4bit/load_in_8bit train LoRA adapters"):
        SFTConfig(model_name="m", load_in_4bit=True)


def test_flash_attention_falls_back_to_sdpa_where_it_cannot_run(capsys, monkeypatch):
    from rl.models.loading import usable_attention

    reset_warnings()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert usable_attention("flash_attention_2") == "sdpa" and usable_attention("eager") == "eager"
    assert "note: key 'attn_implementation' is accepted and ignored (flash_attention_2 needs a CUDA GPU" in \
        capsys.readouterr().err


def test_neftune_noise_in_training_forwards_only():
    from rl.models.loading import add_neftune

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 16)

        def get_input_embeddings(self):
            return self.emb

    m = Tiny()
    ids = torch.arange(8)[None]
    clean = m.emb(ids).detach()
    add_neftune(m, 5.0)
    noisy = m.emb(ids).detach()
    bound = 5.0 / math.sqrt(8 * 16)
    assert 0 < (noisy - clean).abs().max() <= bound
    m.eval()
    torch.testing.assert_close(m.emb(ids), clean)


def test_trdpo_sync_mixes_the_policy_into_the_reference():
    from rl.models.reference import ReferencePolicy

    policy, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in ref.parameters()]
    ReferencePolicy("copy", ref, description="copy").sync(policy, 0.25)
    for r, b, p in zip(ref.parameters(), before, policy.parameters()):
        torch.testing.assert_close(r, 0.25 * p.detach() + 0.75 * b)
    with pytest.raises(ConfigError, match="sync_ref_model with LoRA"):
        DPOConfig(model_name="m", sync_ref_model=True, use_peft=True)


def test_completion_only_loss_null_is_trls_default():
    """null: the completion of prompt/completion rows, the whole text of chat rows (TRL's meaning); true keeps the
    chat's last assistant message as this package's explicit choice."""
    from rl.data.sft import tokenize_examples
    from rl.models.loading import load_tokenizer

    tok = load_tokenizer("tiny:qwen2")
    rows = [{"prompt": "1+1=", "completion": "2"}, {"messages": [{"role": "user", "content": "1+1"},
                                                              {"role": "assistant", "content": "2"}]}]
    for only, masked in ((None, [True, False]), (True, [True, True]), (False, [False, False])):
        cfg = build(SFTConfig, {"model_name": "tiny:qwen2", "completion_only_loss": only})
        out = tokenize_examples(rows, tok, cfg)
        assert [-100 in ex["labels"] for ex in out] == masked, only


def test_system_prompt_makes_each_prompt_a_chat(tmp_path):
    from rl.rollout.prompts import load_prompt_rows

    data = tmp_path / "p.jsonl"
    data.write_text('{"problem": "2+2", "solution": "4"}\n')
    cfg = build(GRPOConfig, {"model_name": "m", "dataset_name": str(data), "dataset_prompt_column": "problem",
                             "system_prompt": "Think first."})
    assert load_prompt_rows(str(data), cfg) == [{"prompt": [{"role": "system", "content": "Think first."},
                                                            {"role": "user", "content": "2+2"}], "solution": "4"}]


def test_rl_train_takes_the_trainer_first_as_trl_does(monkeypatch, capsys):
    from rl.scripts.cli import main

    monkeypatch.setenv("RL_TRAIN_PRINT_ONLY", "1")
    main(["grpo", "--config", "recipe.yaml", "model_name_or_path=x"])
    assert capsys.readouterr().out.strip().endswith("-m rl.scripts.train grpo --config recipe.yaml "
                                                    "model_name_or_path=x")
