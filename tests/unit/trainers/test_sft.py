"""SFT end to end through the launch script: it learns, and 2 processes (DDP, ZeRO-3) match 1."""

import json
import sys

import pytest

from tests.conftest import LEARN_SEED, accelerate_cmd, learned, run_cmd, run_main

RECIPE = "recipes/tiny/sft.yaml"


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.slow
def test_tiny_sft_learns_and_saves_a_loadable_model(tmp_path):
    """It learns: the last logged loss is under half the first. Measured final/first loss ratio over
    seeds 0-3 x {2 threads, 1 thread, AVX2 kernels} (bench/learning_spread.py, 12 runs): 0.066 to 0.110."""
    out = tmp_path / "sft"
    proc = run_cmd([sys.executable, "launch/sft.py", "--config", RECIPE, f"output_dir={out}", "logging_steps=1",
                    "data.eval_fraction=0.125", f"seed={LEARN_SEED}"])
    curve = losses(out)
    assert learned("sft_loss_ratio", curve[-1] / curve[0]) < 0.5, curve[::10]
    assert "sft done" in proc.stdout
    assert (out / "metrics.png").stat().st_size > 1000 and (out / "config.yaml").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("3+4=", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] >= len(tok)
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "eval/loss" in x]
    assert evals and evals[-1]["eval/loss"] < curve[0]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, capfd, monkeypatch):
    """Same global batch (16) as 1 process x 8 x 2 accumulated and 2 x 4 x 2, under DDP and under ZeRO-3:
    each 2-process loss curve agrees with the 1-process one to 1e-5. 19 examples make each epoch one full
    step and one of 3, which leaves rank 1 an empty micro-batch (a zero-weight forward) on the short step.
    The 2-process runs compute their log-probs with the chunked LM head (rl.engine.chunked), the 1-process
    run from full logits. The 1-process run is launch/sft.py's main() in this process (conftest.run_main:
    one intra-op thread, as a run_cmd subprocess), once for both; each 2-process run is two processes of
    its own under `accelerate launch`."""
    common = ["--config", RECIPE, "data.max_examples=19", "num_train_epochs=2", "gradient_accumulation_steps=2",
              "logging_steps=1", "report_to=[jsonl]"]
    one = tmp_path / "one"
    code, stdout, stderr = run_main("sft", [*common, "per_device_train_batch_size=8", f"output_dir={one}"], capfd, monkeypatch)
    assert code == 0, (stdout + stderr)[-3000:]
    a = losses(one)
    assert len(a) == 4 and len(set(a)) == 4
    for zero3 in (False, True):
        two = tmp_path / ("zero3" if zero3 else "ddp")
        proc = run_cmd(accelerate_cmd("launch/sft.py", *common, "per_device_train_batch_size=4", "logprob_chunk_size=5",
                                      f"output_dir={two}", zero3=zero3))
        assert ("ZeRO stage 3" in proc.stdout + proc.stderr) == zero3  # the launcher really ran what is named
        b = losses(two)
        assert len(b) == 4
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (zero3, a, b)


@pytest.mark.slow
def test_lora_outputs_card_tensorboard_quiet_and_bad_data_path(tmp_path):
    """One LoRA run checks what a TRL user finds: the PEFT adapter at output_dir (what TRL writes) and
    nothing merged unless asked; a checkpoint AutoPeftModelForCausalLM loads, equal to the adapter
    saved there; the model card; TensorBoard event files; TRL's SFT metric names; and a stderr
    without third-party FutureWarnings (quiet_third_party: without it PEFT's gradient-checkpointing
    deprecation is printed in this run)."""
    import torch
    from huggingface_hub import ModelCard
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file

    out = tmp_path / "lora"
    proc = run_cmd([sys.executable, "launch/sft.py", "--config", RECIPE, f"output_dir={out}", "max_steps=5",
                    "lora.enabled=true", "lora.rank=4", "learning_rate=1e-2", "save_steps=2", "logging_steps=1",
                    "report_to=[jsonl,tensorboard]"])
    assert "FutureWarning" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr[-2000:]
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert not (out / "config.json").exists() and not (out / "merged").exists()
    # checkpoint-4: the adapter of step 4, read from the checkpoint's full state dict
    ckpt = out / "checkpoints" / "checkpoint-4"
    peft_ckpt = AutoPeftModelForCausalLM.from_pretrained(ckpt)
    full = load_file(str(ckpt / "model.safetensors"))
    lora_keys = [k for k in full if ".lora_B." in k]
    assert lora_keys and all(torch.equal(peft_ckpt.state_dict()[k], full[k]) for k in lora_keys)
    final = AutoPeftModelForCausalLM.from_pretrained(out)
    assert any(not torch.equal(final.state_dict()[k], full[k]) for k in lora_keys)  # step 5 moved on
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "peft" and "sft" in card.data.tags
    for text in ("tiny:llama", "data/tiny/sft_arith.jsonl", "launch/sft.py --config", "| transformers |",
                 "| mean_token_accuracy |", "AutoPeftModelForCausalLM"):
        assert text in card.text, text
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all("lr" not in r for r in rows)
    tokens = [r["num_tokens"] for r in rows]
    assert all(b > a for a, b in zip(tokens, tokens[1:]))  # cumulative
    assert all(0.0 <= r["mean_token_accuracy"] <= 1.0 and r["learning_rate"] > 0 for r in rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "runs" / "lora"))  # <output_dir>/runs/<run_name>, as TRL's logging_dir
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    import subprocess

    bad = subprocess.run([sys.executable, "launch/sft.py", "--config", RECIPE, "data.path=missing.jsonl"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error: data file not found: missing.jsonl" in bad.stderr


@pytest.mark.slow
def test_zero3_lora_saves_adapter_and_merged_model(tmp_path):
    """LoRA under ZeRO-3: the live modules hold shards, so adapter and merge come from the gathered
    state; save_merged=true adds the merged model in merged/, which loads without peft and computes
    what the adapter does (dropout only acts in training). Two processes, and no FutureWarning line."""
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    out = tmp_path / "z3lora"
    proc = run_cmd(accelerate_cmd("launch/sft.py", "--config", RECIPE, "max_steps=3", "per_device_train_batch_size=8",
                                  "lora.enabled=true", "lora.rank=4", "save_merged=true", f"output_dir={out}",
                                  zero3=True))
    assert "FutureWarning" not in proc.stderr, proc.stderr[-2000:]  # DeepSpeed printed thousands (quiet_third_party)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 256, (2, 12))
    assert (adapter(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() < 1e-4
    assert (out / "merged" / "README.md").exists() and (out / "README.md").exists()


def test_lora_adapter_and_merged_saves_equal_peft_forward(tiny_llama, tmp_path):
    """save_pretrained of a LoRA model: the adapter at the output dir (PEFT's own loaders and ours read
    it) and, with merged=True, the merged model in merged/ (plain transformers); all compute the trained
    model's logits, which differ from the base model's."""
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from rl.models.loading import apply_lora, load_causal_lm, load_tokenizer
    from rl.models.saving import MERGED_DIR, save_pretrained
    from rl.scripts.common import model_problem
    from rl.scripts.dryrun import load_model_config

    for family in ("llama", "gpt2"):  # gpt2: Conv1D stores W transposed
        torch.manual_seed(0)
        model = apply_lora(load_causal_lm(f"tiny:{family}", dtype="float32"), 4, 8, 0.0)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero; make the adapter matter
                torch.nn.init.normal_(p, std=0.5)
        ids = torch.randint(0, 256, (2, 10))
        model.eval()
        expected = model(input_ids=ids).logits
        out = tmp_path / family
        save_pretrained(model, load_tokenizer(f"tiny:{family}"), str(out), merged=True)
        merged = AutoModelForCausalLM.from_pretrained(out / MERGED_DIR).eval()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        base = load_causal_lm(f"tiny:{family}", dtype="float32")
        loaded = {"merged": merged, "PeftModel": PeftModel.from_pretrained(base, out),
                  "AutoPeftModelForCausalLM": AutoPeftModelForCausalLM.from_pretrained(out),
                  "load_causal_lm": load_causal_lm(str(out), dtype="float32")}
        for how, m in loaded.items():
            assert (m.eval()(input_ids=ids).logits - expected).abs().max() < 1e-4, how
        assert type(loaded["load_causal_lm"]).__name__ == type(merged).__name__  # merged on load: a plain model
        assert (expected - load_causal_lm(f"tiny:{family}", dtype="float32")(input_ids=ids).logits).abs().max() > 1e-2
        # the adapter directory is a valid model_name for the next stage (preflight, dry-run sizes)
        assert model_problem("model_name", str(out)) is None
        assert load_model_config(str(out)).model_type == merged.config.model_type
    # LoRA on top of that output: the new adapter names the first as its base, and our loader applies both
    torch.manual_seed(1)
    second = apply_lora(load_causal_lm(str(out), dtype="float32"), 4, 8, 0.0)
    for name, p in second.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    expected = second.eval()(input_ids=ids).logits
    save_pretrained(second, None, str(tmp_path / "stacked"))
    assert json.loads((tmp_path / "stacked" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(out)
    chained = load_causal_lm(str(tmp_path / "stacked"), dtype="float32")
    assert (chained(input_ids=ids).logits - expected).abs().max() < 1e-4
    # PEFT's loaders would drop the first adapter: the card says how to load it instead
    from rl.config.fields import build
    from rl.models.card import write_model_card
    from rl.trainers.sft import SFTConfig

    cfg = build(SFTConfig, {"model_name": str(out), "output_dir": str(tmp_path / "stacked"), "lora": {"enabled": True}})
    assert "**Stacked adapter**" in write_model_card(tmp_path / "stacked", cfg, [], "sft", argv=[]).read_text()
