"""What a run leaves for a TRL user: trackers (TensorBoard read back), metric names, model cards,
checkpoints that `from_pretrained` loads, and quiet third-party logs. Fast, in-process; the end-to-end
checks ride on the SFT LoRA runs in tests/unit/trainers/test_sft.py."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from rl.config.fields import build
from rl.config.schema import report_to_problem
from rl.engine import tracking
from rl.engine.tracking import Tracker, flat_config, quiet_third_party, y_label
from rl.errors import ConfigError
from rl.trainers.sft import SFTConfig


def test_tensorboard_holds_what_jsonl_holds(tmp_path):
    """Three logged steps reach TensorBoard (through accelerate's tracker) with the same values and
    steps as metrics.jsonl; strings stay out of the scalars; the bar total is settable later."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"loss": 2.0, "learning_rate": 1e-3, "eval/loss": 2.5}, {"loss": 1.5, "learning_rate": 5e-4},
            {"loss": 1.25, "learning_rate": 0.0, "note": "text"}]
    t = Tracker(tmp_path, ["jsonl", "tensorboard"], run_name="run", config={"lora": {"rank": 4}, "report_to": ["x"]},
                desc="t")
    t.set_total(3)
    assert t._bar.total == 3
    for step, row in enumerate(rows, 1):
        t.log(step, row)
    t.close()
    acc = EventAccumulator(str(tmp_path / "runs" / "run"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.0), (2, 1.5), (3, 1.25)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(1, 2.5)]
    assert [e.value for e in acc.Scalars("learning_rate")] == pytest.approx([1e-3, 5e-4, 0.0])
    assert "note" not in acc.Tags()["scalars"]
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged] == [2.0, 1.5, 1.25] and logged[2]["note"] == "text"
    assert (tmp_path / "metrics.png").stat().st_size > 1000


def test_a_grpo_run_written_to_a_file_prints_a_line_per_logging_step(tmp_path, tiny_llama):
    """`python launch/grpo.py ... > log`: stdout is a file (no terminal, no progress bar), and it holds one
    console line per row of metrics.jsonl, step over total, in fixed columns, between the banner and the summary."""
    import re
    import subprocess
    import sys

    from tests.conftest import ROOT

    out, log = tmp_path / "run", tmp_path / "log"
    with log.open("w") as f:
        r = subprocess.run([sys.executable, "launch/grpo.py", "--config", "recipes/tiny/grpo.yaml", f"model_name={tiny_llama}",
                            "max_steps=4", "logging_steps=2", "eval_steps=0", "eval_num_prompts=4",
                            "reward_funcs=[default]", f"output_dir={out}"], cwd=ROOT, stdout=f, stderr=subprocess.PIPE,
                           text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = log.read_text().splitlines()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    shown = [x for x in lines if x.startswith("step ")]
    assert steps == [0, 2, 4] and [x.split(" |")[0] for x in shown] == ["step 0/4", "step 2/4", "step 4/4"], lines
    assert lines[0].startswith("grpo (") and lines[-1].startswith("grpo done:") and len(lines) == 2 + len(shown)
    for line in shown[1:]:
        assert re.fullmatch(r"step \d/4 \| loss +\S+ \| reward +\S+ \| reward_std +\S+ \| grad_norm +\S+ \| "
                            r"learning_rate \S+ \| tokens/s +[\d,]+ \| elapsed \d:\d\d:\d\d \| eta \d:\d\d:\d\d"
                            r"( \| eval/accuracy \S+ \| eval/reward \S+)?", line), line
    assert [line.index("| learning_rate") for line in shown[1:]] == [shown[1].index("| learning_rate")] * 2


def test_flat_config_and_y_labels():
    assert flat_config({"a": 1, "lora": {"rank": 4, "alpha": None}, "report_to": ["jsonl"]}) == \
        {"a": 1, "lora.rank": 4, "lora.alpha": "None", "report_to": "['jsonl']"}
    assert y_label("eval/rewards/accuracies") == "accuracies" and y_label("learning_rate") == "learning rate"


def test_metrics_plot_has_no_constant_panels_and_whole_step_ticks(tmp_path, monkeypatch):
    """metrics.png: a constant learning rate took a panel of its own, and a 3-step run had ticks at 1.5, 2.5."""
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    history = [{"step": s, "time": 0.1 * s, "loss": 3.0 / s, "learning_rate": 1e-3, "clipped": 0} for s in (1, 2, 3)]
    tracking.plot_history(history, tmp_path / "metrics.png")
    axes = [ax for ax in figures[0].axes if ax.axison]
    assert [ax.get_title() for ax in axes] == ["loss"]
    ticks = [t for t in axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    tracking.plot_history(history[:1], tmp_path / "metrics.png")  # one step: nothing moves, every panel stays
    assert [ax.get_title() for ax in figures[1].axes if ax.axison] == ["loss", "learning_rate", "clipped"]


def test_progress_bar_only_on_a_terminal(monkeypatch):
    """The bar redraws with carriage returns: in a log file (stderr not a terminal) every update was spliced
    into one line. RL_NO_PROGRESS=1 / 0 force it off / on."""
    import io
    import sys

    monkeypatch.delenv("RL_NO_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not tracking.progress_bar_wanted()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert tracking.progress_bar_wanted()
    monkeypatch.setenv("RL_NO_PROGRESS", "1")
    assert not tracking.progress_bar_wanted()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    monkeypatch.setenv("RL_NO_PROGRESS", "0")
    assert tracking.progress_bar_wanted()


def test_report_to_names_unknown_and_missing_sinks(monkeypatch):
    assert report_to_problem(["jsonl", "none"]) is None
    assert "unknown sink 'tensorbored'" in report_to_problem(["tensorbored"])
    monkeypatch.setitem(tracking.SINKS, "mlflow", "surely_not_installed_pkg")
    problem = report_to_problem(["jsonl", "mlflow"])
    assert problem == ("key 'report_to': mlflow needs the surely_not_installed_pkg package; pip install "
                       "surely_not_installed_pkg, or drop mlflow")
    with pytest.raises(ConfigError, match="unknown sink"):
        build(SFTConfig, {"model_name": "m", "report_to": ["tensorbored"]})
    with pytest.raises(ConfigError, match="key 'save_merged': only a LoRA run"):
        build(SFTConfig, {"model_name": "m", "save_merged": True})


def test_quiet_third_party_hides_future_warnings_unless_verbose(monkeypatch):
    for key in ("PYTHONWARNINGS", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(key, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party(verbose=True)
        warnings.warn("shown", FutureWarning)
        quiet_third_party(verbose=False)
        warnings.warn("hidden", FutureWarning)
        warnings.warn("kept", UserWarning)
    assert [str(w.message) for w in seen] == ["shown", "kept"]
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and "FutureWarning" in os.environ["PYTHONWARNINGS"]
    import logging

    ds = logging.getLogger("DeepSpeed")
    assert not ds.filters[-1].filter(logging.makeLogRecord({"levelno": logging.WARNING}))
    assert ds.filters[-1].filter(logging.makeLogRecord({"levelno": logging.ERROR}))


def test_bitsandbytes_kernel_hub_lines_are_filtered_from_import_rl_on():
    """peft imports bitsandbytes at its own import, and bitsandbytes 0.50 then logs two kernels-community lines
    on CPUs with AVX-512 bf16 (seen in every run on this machine's CPU): filtered by `import rl`, other lines kept."""
    import logging

    import rl  # noqa: F401 - the import installs the filters

    def shown(logger: str, msg: str) -> bool:
        return all(f.filter(logging.makeLogRecord({"msg": msg})) for f in logging.getLogger(logger).filters)

    assert not shown("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: x")
    assert not shown("kernels._internals.hf_hub", "Skipping publisher trust check for 'kernels-community/q' because")
    assert shown("bitsandbytes.backends.cpu.ops", "any other line")


def test_correct_tokens_by_hand():
    """Labels shift by one: position t's logits predict label t+1; -100 labels are not counted."""
    from rl.trainers.sft import correct_tokens

    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 2] = logits[0, 1, 3] = logits[0, 2, 1] = 1.0  # argmax 2, 3, 1 (and 0 at the last position)
    labels = torch.tensor([[-100, 2, 4, 1]])  # predicted: 2 right, 4 wrong, 1 right
    assert int(correct_tokens(logits, labels)) == 2
    assert int(correct_tokens(logits, torch.tensor([[-100, -100, -100, 1]]))) == 1


def test_model_card_lists_what_the_run_was(tmp_path):
    from huggingface_hub import ModelCard

    from rl.models.card import card_text, final_metrics, write_model_card
    from rl.trainers.dpo import DPOConfig

    cfg = build(DPOConfig, {"model_name": "Qwen/Qwen2.5-0.5B-Instruct", "output_dir": str(tmp_path),
                            "loss_type": "ipo", "data": {"path": "data/pairs.jsonl"}})
    history = [{"step": 1, "loss": 0.7, "time": 3.0}, {"step": 2, "loss": 0.5, "eval/rewards/accuracies": 0.75}]
    assert final_metrics(history) == {"loss": 0.5, "eval/rewards/accuracies": 0.75}
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("loss_type: ipo\n")
    path = write_model_card(tmp_path, cfg, history, "dpo", argv=["launch/dpo.py", "--config", "r.yaml", "beta=0.2"])
    card = ModelCard.load(path)
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct" and card.data.library_name == "transformers"
    for text in ("loss_type=ipo", "`data/pairs.jsonl`", "launch/dpo.py --config r.yaml beta=0.2",
                 "| loss | 0.5 |", "| eval/rewards/accuracies | 0.75 |", "`config.yaml`",
                 f"| torch | {torch.__version__} |", "AutoModelForCausalLM.from_pretrained"):
        assert text in card.text, text
    # a local or tiny base model is named in the text, not as the hub's base_model
    local = build(DPOConfig, {"model_name": "tiny:llama", "output_dir": str(tmp_path)})
    assert "base_model" not in card_text(local, [], "dpo", argv=[]).split("---")[1]


def test_checkpoint_of_a_full_model_loads_with_from_pretrained(tiny_llama, tiny_tokenizer, tmp_path):
    """make_loadable beside a checkpoint's model.safetensors (written as the engine writes it, shared
    tensors once): `from_pretrained(checkpoint)` computes the saved model's logits; our own model
    types (here a plain nn.Module) are left alone."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rl.engine.state import _dedupe_shared
    from rl.models.saving import make_loadable

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the base weights
    save_file(_dedupe_shared(model.state_dict()), str(tmp_path / "model.safetensors"))
    assert make_loadable(tmp_path, model, tiny_tokenizer)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 256, (2, 9))
    assert torch.allclose(again(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)
    assert (tmp_path / "tokenizer.json").exists()
    assert make_loadable(tmp_path / "x", torch.nn.Linear(2, 2)) is False


def _perturbed(model, seed: int = 0):
    """`model` with every trainable weight moved off its initial value (LoRA's B starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def _round_trip(make_model, tmp_path):
    """save_state of a fresh model's engine, then load_state into another fresh one: (saved model,
    checkpoint dir, reloaded model); the reload must equal the saved model tensor for tensor."""
    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.models.saving import make_loadable

    def pipeline(model):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return ForwardBackwardPipeline(model, device="cpu", optimizer=opt, checkpoint_dir=tmp_path)

    saved = _perturbed(make_model())
    ckpt = Path(pipeline(saved).save_state("checkpoint-3")["path"])
    make_loadable(ckpt, saved)
    again = make_model()
    pipeline(again).load_state(ckpt)
    theirs = again.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in saved.state_dict().items())
    return saved, ckpt, again


@pytest.mark.parametrize("lora", [False, True])
def test_ppo_checkpoint_loads_with_from_pretrained_and_resumes(tiny_llama, tmp_path, lora):
    """A PPO checkpoint-N/ is the final output's layout: the policy alone (full: config.json +
    model.safetensors for AutoModelForCausalLM; LoRA: the PEFT adapter for PeftModel) with the value
    head beside it in value_head.safetensors; both compute the saved model's logits and values, and
    the engine resumes from the same files exactly."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rl.models.loading import apply_lora
    from rl.models.value import PPOModel, ValueHead

    def make():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama)
        return PPOModel(apply_lora(base, rank=4, alpha=8, dropout=0.0) if lora else base)

    saved, ckpt, _ = _round_trip(make, tmp_path)
    if lora:
        assert not (ckpt / "model.safetensors").exists() and (ckpt / "adapter_config.json").exists()
        policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), ckpt)
    else:
        assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        policy = AutoModelForCausalLM.from_pretrained(ckpt)
    head = ValueHead(saved.config.hidden_size)
    head.load_state_dict(load_file(str(ckpt / "value_head.safetensors")))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = saved(input_ids=ids)
        out = policy.eval()(input_ids=ids, output_hidden_states=True)
        assert torch.allclose(out.logits, ours.logits, atol=1e-6)
        assert torch.allclose(head(out.hidden_states[-1]), ours.value, atol=1e-6)
        assert ours.value.abs().max() > 0  # the head moved: the comparison can fail
    from rl.models.card import card_text, output_contents
    from rl.trainers.ppo_config import PPOConfig

    card = card_text(build(PPOConfig, {"model_name": "tiny:llama", "output_dir": str(ckpt)}), [], "ppo", argv=[],
                     contents=output_contents(ckpt))
    assert "`value_head.safetensors`" in card and ("AutoPeftModelForCausalLM" in card) is lora
    (ckpt / "value_head.safetensors").unlink()  # a checkpoint that lost a file is not resumed from
    with pytest.raises(FileNotFoundError):
        saved.load_checkpoint_weights(ckpt)


@pytest.mark.parametrize("lora", [False, True])
def test_reward_checkpoint_loads_as_a_sequence_classifier_and_resumes(tiny_llama, tiny_tokenizer, tmp_path, lora):
    """A reward trainer's checkpoint-N/ is what save_model writes: full -> AutoModelForSequenceClassification
    (temperature folded into score.weight); LoRA -> a PEFT SEQ_CLS adapter on that classifier. Both give
    our rewards (last-token pooling, pad != eos); load_reward_model reads it too; resume is exact."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from rl.data.preference import pad_batch
    from rl.models.card import _loading, output_contents
    from rl.models.reward import RewardModel, RewardModelConfig, load_reward_model

    cfg = RewardModelConfig(model_name=tiny_llama, use_lora=lora, lora_rank=4, lora_dropout=0.0, dropout_prob=0.0,
                            temperature=2.0, dtype="float32")

    def make():
        torch.manual_seed(0)
        return RewardModel(cfg, tokenizer=tiny_tokenizer)

    saved, ckpt, _ = _round_trip(make, tmp_path)
    if lora:
        base = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=1)
        hf = PeftModel.from_pretrained(base, ckpt)
    else:
        hf = AutoModelForSequenceClassification.from_pretrained(ckpt)
    ids, mask = pad_batch(saved.encode(["a nice answer", "poor"]), saved.pad_token_id)
    with torch.no_grad():
        ours = saved.rewards(ids, mask)[:, 0]
        assert torch.allclose(hf.eval()(input_ids=ids, attention_mask=mask).logits[:, 0], ours, atol=1e-5)
        assert torch.allclose(load_reward_model(ckpt).rewards(ids, mask)[:, 0], ours, atol=1e-6)
    assert json.loads((ckpt / "reward_config.json").read_text())["hf_compatible"] is True
    # the model card calls it a reward model (not a causal-LM adapter) and shows the loader that fits
    assert output_contents(ckpt) == "reward"
    loading = "\n".join(_loading("reward", str(ckpt)))
    assert ("PeftModel.from_pretrained(base" in loading) is lora and "AutoModelForSequenceClassification" in loading
    if lora:  # its PEFT adapter is a classifier's: as a policy (chat, a next stage's model_name) one line
        from rl.errors import ConfigError
        from rl.models.loading import load_causal_lm

        with pytest.raises(ConfigError, match="is a reward model .a classifier, as launch/reward.py writes it., not a causal LM"):
            load_causal_lm(str(ckpt))


def test_ppo_sampling_warns_nothing_and_its_output_is_a_model_output(tiny_llama, tiny_tokenizer):
    """Log hygiene at the source, with every warning shown: sampling through PPO's policy passes the
    KV cache under the keyword this transformers version takes (no deprecated `past_key_values`
    warning), and PPOModelOutput is a ModelOutput (ZeRO-3 and accelerate know its fields)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import ModelOutput

    from rl.engine.generation import generate
    from rl.models.value import PPOModel

    model = PPOModel(AutoModelForCausalLM.from_pretrained(tiny_llama)).eval()
    prompts = [tiny_tokenizer("1+1=")["input_ids"], tiny_tokenizer("12+30=")["input_ids"]]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rollout = generate(model, tiny_tokenizer, prompts, max_new_tokens=3, temperature=1.0, seed=0)
        out = model(input_ids=rollout.tokens[:, :2], use_cache=False)  # as PPO's training forwards
    assert [str(w.message) for w in seen if "past_key_values" in str(w.message) or "cache" in str(w.message)] == []
    assert isinstance(out, ModelOutput) and set(out.keys()) == {"logits", "value"}
    assert out["value"].shape == (2, 2) and rollout.tokens.shape[0] == 2


class _Killed(BaseException):
    """A SIGKILL stand-in: nothing of ours runs after it (no `except Exception` catches it)."""


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpoint_killed_right_after_its_rename_loads_with_from_pretrained(lora, tiny_llama, tmp_path,
                                                                             monkeypatch):
    """Issue 39 point 9: the process dies right after `.tmp-checkpoint-1` becomes `checkpoint-1` (the
    rename done, nothing after it run); the checkpoint still holds what from_pretrained reads (config.json or
    the adapter files, the tokenizer), as docs/outputs.md promises: they are written inside the atomic write,
    before COMPLETE and the rename, no longer after it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.data.sft import tokenize_examples
    from rl.engine.state import complete_checkpoints
    from rl.trainers.sft import SFTTrainer

    real = os.replace

    def replace_then_die(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if Path(str(src)).name == ".tmp-checkpoint-1":
            raise _Killed

    cfg = build(SFTConfig, {"model_name": tiny_llama, "output_dir": str(tmp_path / "run"), "max_steps": 2,
                            "save_steps": 1, "per_device_train_batch_size": 2, "report_to": ["none"],
                            "lora": {"enabled": lora, "rank": 2, "target_modules": "q_proj"}})
    trainer = SFTTrainer(cfg)
    data = tokenize_examples([{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(4)], trainer.tokenizer,
                             cfg)
    monkeypatch.setattr(os, "replace", replace_then_die)
    with pytest.raises(_Killed):
        trainer.train(data)
    monkeypatch.setattr(os, "replace", real)
    (ckpt,) = complete_checkpoints(tmp_path / "run")
    assert AutoTokenizer.from_pretrained(ckpt).vocab_size == trainer.tokenizer.vocab_size
    if lora:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(ckpt)
        assert model.peft_config["default"].r == 2
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt)
    want = trainer.pipeline.unwrapped_model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if ".lora_" in k or not lora)
