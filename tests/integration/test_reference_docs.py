"""The reference docs' examples, run as written (issue 15): the engine and client snippets of
`rl-module-docs.pt.md` and the Python API of `ppo-cli-docs.pt.md`.

Each snippet below is the doc's text, verbatim. `run_doc` changes only what the docs tell users to
change (the import path `autotrain.trainers.rl` -> `rl`) plus what a CPU test must: the model names
become tiny local models, `device="cuda"` becomes the device this machine has, and a `# ... compute
loss ...` placeholder becomes one line of loss. Everything else the snippet needs (model, batch,
optimizer) is defined by the test, as a user would have it; the checks after each snippet are
numbers, not just "it ran".
"""

from __future__ import annotations

import pytest
import torch

from rl.errors import ConfigError
from tests.conftest import ROOT
from tests.unit.engine.test_client import _batch as _padded

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The reference's examples run as written without a warning (issue 46): Python warnings are errors here.
pytestmark = pytest.mark.filterwarnings("error")


def run_doc(snippet: str, namespace: dict, replace: dict | None = None) -> dict:
    """exec a doc snippet after the documented import-path change and the given replacements."""
    code = snippet.replace("autotrain.trainers.rl", "rl").replace('device="cuda"', f'device="{DEVICE}"')
    for old, new in (replace or {}).items():
        assert old in code, f"the snippet no longer contains {old!r}"
        code = code.replace(old, new)
    exec(compile(code, "<reference doc snippet>", "exec"), namespace)
    return namespace


def _model(path):
    from rl.models.loading import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(path, dtype="float32")


def _batch(tok, texts=("hello there", "general kenobi")):
    b = _padded(tok, texts)  # tests/unit/engine/test_client.py's right-padded batch
    return b["input_ids"], b["attention_mask"]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------ rl-module-docs: "Pipeline Forward-Backward"

PIPELINE = '''
from autotrain.trainers.rl import ForwardBackwardPipeline

# Low-level pipeline
pipeline = ForwardBackwardPipeline(
    model=model,
    device="cuda",
    max_workers=2,                    # Thread pool size
    gradient_accumulation_steps=4,
)

# Queue forward-backward pass
future = pipeline.forward_backward(
    input_ids=input_ids,
    attention_mask=attention_mask,
    labels=labels,
    loss_fn="cross_entropy",
)

# Get result (blocks until complete)
result = future.result()
print(f"Loss: {result.loss}")

# Queue optimizer step
optim_future = pipeline.optim_step(
    optimizer=optimizer,
    scheduler=scheduler,  # Optional
    max_grad_norm=1.0,
)
optim_result = optim_future.result()
'''

CUSTOM_LOSS = '''
def custom_loss_fn(model, inputs, outputs, **kwargs):
    # Your custom loss computation
    logits = outputs.logits
    # ... compute loss ...
    return loss_tensor  # Must be scalar

future = pipeline.forward_backward_custom(
    input_ids=input_ids,
    custom_loss_fn=custom_loss_fn,
    attention_mask=attention_mask,  # Optional
    my_param=42,  # Passed to loss function via kwargs
)
'''

CHECKPOINTING = '''
# Save checkpoint
checkpoint_info = pipeline.save_state("checkpoint_1000")
# Returns: {"path": ..., "model_path": ..., "optimizer_path": ..., "state_path": ...}

# Load checkpoint
pipeline.load_state("checkpoints/checkpoint_1000")
'''

SAMPLING = '''
samples = pipeline.sample(
    prompt=prompt_tokens,  # List[int] or Tensor
    max_tokens=100,
    temperature=0.7,
    top_k=50,
    top_p=0.9,
    stop=[tokenizer.eos_token_id],
)

print(f"Generated: {samples['tokens']}")
print(f"Logprobs: {samples['logprobs']}")
print(f"Prompt: {samples['prompt']}")
'''


def _pipeline_namespace(tiny_llama, tiny_tokenizer, lr=0.1):
    model = _model(tiny_llama)
    input_ids, attention_mask = _batch(tiny_tokenizer)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    return {"model": model, "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
            "optimizer": optimizer, "scheduler": scheduler, "tokenizer": tiny_tokenizer}


def test_pipeline_example_one_micro_batch_of_four(tiny_llama, tiny_tokenizer, capsys):
    """gradient_accumulation_steps=4, ONE forward_backward, then optim_step (15.2): the step applies
    that micro-batch's gradient, exactly as gradient_accumulation_steps=1 would."""
    ns = _pipeline_namespace(tiny_llama, tiny_tokenizer)
    start = _params(ns["model"])
    run_doc(PIPELINE, ns)
    r = ns["optim_result"]
    assert capsys.readouterr().out.startswith(f"Loss: {ns['result'].loss}")
    assert ns["result"].loss > 0 and ns["result"].num_tokens == int((ns["labels"][:, 1:] != -100).sum())
    assert (r.step, r.metrics["num_micro_batches"]) == (1, 1)
    assert r.learning_rate == pytest.approx(0.05)  # the scheduler stepped: 0.1 * 0.5

    # the same step with gradient_accumulation_steps=1 on the same micro-batch
    from rl import ForwardBackwardPipeline

    ref = _pipeline_namespace(tiny_llama, tiny_tokenizer)
    one = ForwardBackwardPipeline(ref["model"], device=DEVICE, gradient_accumulation_steps=1)
    one.forward_backward(ref["input_ids"], ref["attention_mask"], ref["labels"]).result()
    r1 = one.optim_step(ref["optimizer"], ref["scheduler"], max_grad_norm=1.0).result()
    assert r.grad_norm == pytest.approx(r1.grad_norm, rel=1e-6)
    assert _max_diff(_params(ns["model"]), start) > 1e-3
    assert _max_diff(_params(ns["model"]), _params(ref["model"])) < 1e-6


def test_custom_loss_example(tiny_llama, tiny_tokenizer):
    """The custom-loss snippet, after the pipeline snippet; `my_param` reaches the loss."""
    ns = run_doc(PIPELINE, _pipeline_namespace(tiny_llama, tiny_tokenizer))
    seen = []
    ns["seen"] = seen
    body = "seen.append(kwargs); loss_tensor = logits.float().pow(2).mean() * kwargs['my_param'] / 42"
    run_doc(CUSTOM_LOSS, ns, {"# ... compute loss ...": body})
    res = ns["future"].result()
    assert seen == [{"my_param": 42}]
    with torch.no_grad():
        logits = ns["pipeline"].unwrapped_model(input_ids=ns["input_ids"], attention_mask=ns["attention_mask"]).logits
    assert res.loss == pytest.approx(logits.float().pow(2).mean().item(), rel=1e-5)
    step = ns["pipeline"].optim_step(ns["optimizer"]).result()  # the custom micro-batch is applied
    assert (step.step, step.metrics["num_micro_batches"]) == (2, 1)


def test_builtin_loss_table(tiny_llama, tiny_tokenizer):
    """The table's losses with their documented kwargs. At old = current log-probs the importance
    ratio is exactly 1, so the importance-sampling loss is -mean(advantages) = -1.5 (by hand)."""
    ns = run_doc(PIPELINE, _pipeline_namespace(tiny_llama, tiny_tokenizer))
    pipe, ids, mask, labels = ns["pipeline"], ns["input_ids"], ns["attention_mask"], ns["labels"]
    old = pipe.forward(ids, mask, labels).result().outputs
    adv = torch.tensor([1.0, 2.0])
    r = pipe.forward_backward(ids, mask, labels, loss_fn="importance_sampling", old_logprobs=old,
                              advantages=adv.clone()).result()
    n = (labels[:, 1:] != -100).sum(-1).float()
    assert r.loss == pytest.approx(-float((adv * n).sum() / n.sum()), abs=1e-5)  # token mean of -ratio*A
    values = torch.zeros_like(old)
    returns = torch.ones_like(old)
    r = pipe.forward_backward(ids, mask, labels, loss_fn="ppo", old_log_probs=old, advantages=adv,
                              values=values, returns=returns).result()
    assert r.metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and "loss/total" in r.metrics
    assert pipe.optim_step(ns["optimizer"]).result().metrics["num_micro_batches"] == 2


def test_checkpointing_example(tiny_llama, tiny_tokenizer, tmp_path, monkeypatch):
    """save_state returns the documented dict directly (15.1); load_state of the documented path
    restores the weights after more training."""
    monkeypatch.chdir(tmp_path)
    ns = run_doc(PIPELINE, _pipeline_namespace(tiny_llama, tiny_tokenizer))
    pipe = ns["pipeline"]
    saved = _params(pipe.unwrapped_model)
    run_doc(CHECKPOINTING, ns)  # saves, then loads what it saved
    info = ns["checkpoint_info"]
    assert set(info) == {"path", "model_path", "optimizer_path", "state_path"}
    assert info["path"] == "checkpoints/checkpoint_1000"
    assert all((tmp_path / info[k]).exists() for k in ("path", "model_path", "optimizer_path", "state_path"))
    assert _max_diff(_params(pipe.unwrapped_model), saved) == 0
    pipe.forward_backward(ns["input_ids"], ns["attention_mask"]).result()
    assert pipe.optim_step(ns["optimizer"]).result().step == 2
    assert _max_diff(_params(pipe.unwrapped_model), saved) > 1e-4
    pipe.load_state("checkpoints/checkpoint_1000")  # the snippet's second call, after training on
    assert _max_diff(_params(pipe.unwrapped_model), saved) == 0 and pipe.step == 1


def test_sampling_example(tiny_llama, tiny_tokenizer, capsys):
    ns = run_doc(PIPELINE, _pipeline_namespace(tiny_llama, tiny_tokenizer))
    ns["prompt_tokens"] = tiny_tokenizer.encode("once upon")
    run_doc(SAMPLING, ns)
    s = ns["samples"]
    out = capsys.readouterr().out
    assert f"Prompt: {ns['prompt_tokens']}" in out and "Generated: [" in out
    assert s["prompt"] == ns["prompt_tokens"]
    assert 1 <= len(s["tokens"]) == len(s["logprobs"]) <= 100 and all(lp <= 0 for lp in s["logprobs"])


# ------------------------------------------------------------------ rl-module-docs: "Cliente de Alto Nível"

CLIENT = '''
from autotrain.trainers.rl.forward_backward import AsyncTrainingClient

client = AsyncTrainingClient(
    model=model,
    reference_model=reference_model,  # For PPO/DPO
    device="cuda",
    gradient_accumulation_steps=4,
)

# Training step
fwd_future = client.forward_backward(batch, loss_fn="cross_entropy")
optim_future = client.optim_step(optimizer, max_grad_norm=1.0)

# Forward only (for reference model)
ref_future = client.forward(batch, use_reference=True)

# Clean up
client.shutdown()
'''


def _client_namespace(tiny_llama, tiny_tokenizer):
    model, reference_model = _model(tiny_llama), _model(tiny_llama)
    input_ids, attention_mask = _batch(tiny_tokenizer)
    return {"model": model, "reference_model": reference_model,
            "batch": {"input_ids": input_ids, "attention_mask": attention_mask},
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_client_example(tiny_llama, tiny_tokenizer):
    ns = _client_namespace(tiny_llama, tiny_tokenizer)
    start = _params(ns["model"])
    run_doc(CLIENT, ns)
    step = ns["optim_future"].result()
    assert (step.step, step.metrics["num_micro_batches"]) == (1, 1)
    assert ns["fwd_future"].result().loss > 0
    ref = ns["ref_future"].result()
    assert ref.outputs.shape == (2, ns["batch"]["input_ids"].shape[1] - 1)
    assert _max_diff(_params(ns["model"]), start) > 1e-3  # the policy moved ...
    assert _max_diff(_params(ns["reference_model"]), start) == 0  # ... the reference did not
    # the reference's log-probs were those of the start weights (the frozen copy)
    from rl.engine.scoring import sequence_logprobs

    with torch.no_grad():
        lp, m = sequence_logprobs(_model(tiny_llama), ns["batch"]["input_ids"], ns["batch"]["attention_mask"])
    assert torch.allclose(ref.outputs, lp * m, atol=1e-5)


def test_client_example_error_in_the_unread_optim_future_is_raised_at_shutdown(tiny_llama, tiny_tokenizer, caplog):
    """The doc never reads `optim_future`: with an optimizer missing, its error reaches the user
    at `client.shutdown()` (and the log), instead of vanishing."""
    import logging

    ns = _client_namespace(tiny_llama, tiny_tokenizer)
    ns["optimizer"] = None
    with caplog.at_level(logging.ERROR, logger="rl.engine.futures"):
        with pytest.raises(RuntimeError, match="optim_step: ValueError: optim_step needs an optimizer"):
            run_doc(CLIENT, ns)
    assert any("optim_step failed and its future was never read" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ ppo-cli-docs: "Python API"

PYTHON_API = '''
from autotrain.trainers.clm.params import LLMTrainingParams
from autotrain.project import AutoTrainProject
params = LLMTrainingParams(
model="google/gemma-3-270m",
data_path="./prompts.jsonl",
project_name="ppo-model",
trainer="ppo",
rl_reward_model_path="./reward-model",
# PPO hyperparameters
rl_gamma=0.99,
rl_gae_lambda=0.95,
rl_kl_coef=0.1,
rl_clip_range=0.2,
rl_num_ppo_epochs=4,
epochs=1,
batch_size=4,
lr=1e-5,
)
project = AutoTrainProject(params=params, backend="local", process=True)
project.create()
'''

API_IMPORTS = {"from autotrain.trainers.clm.params import LLMTrainingParams": "from rl import LLMTrainingParams",
               "from autotrain.project import AutoTrainProject": "from rl import AutoTrainProject"}


def test_python_api_translates_like_rl_train(monkeypatch, capsys):
    """The doc's parameters become exactly the arguments `rl-train` gives launch/ppo.py."""
    from rl.scripts.autotrain import translate_params

    doc = dict(model="google/gemma-3-270m", data_path="./prompts.jsonl", project_name="ppo-model",
               rl_reward_model_path="./reward-model", rl_gamma=0.99, rl_gae_lambda=0.95, rl_kl_coef=0.1,
               rl_clip_range=0.2, rl_num_ppo_epochs=4, epochs=1, batch_size=4, lr=1e-5)  # the snippet's keywords
    assert translate_params("ppo", doc) == [
        "--model_name", "google/gemma-3-270m", "--data.path", "./prompts.jsonl", "--output_dir", "ppo-model",
        "--rl_reward_model_path", "./reward-model", "--rl_gamma", "0.99", "--rl_gae_lambda", "0.95",
        "--rl_kl_coef", "0.1", "--rl_clip_range", "0.2", "--rl_num_ppo_epochs", "4", "--num_train_epochs", "1",
        "--per_device_train_batch_size", "4", "--learning_rate", "1e-05"]
    # the same command as rl-train, on a trainer whose doc parameters validate today (sft)
    from rl import AutoTrainProject, LLMTrainingParams
    from rl.scripts.cli import main

    params = LLMTrainingParams(model="tiny:llama", data_path="data/tiny/sft_arith.jsonl", project_name="out",
                               trainer="sft", epochs=2, batch_size=4, lr=1e-5, max_steps=3)
    monkeypatch.setenv("RL_TRAIN_PRINT_ONLY", "1")
    main(["--trainer", "sft", "--model", "tiny:llama", "--data-path", "data/tiny/sft_arith.jsonl", "--project-name",
          "out", "--epochs", "2", "--batch-size", "4", "--lr", "1e-05", "--max_steps=3"])
    assert capsys.readouterr().out.split() == AutoTrainProject(params=params, backend="local", process=True).command()
    assert (params.model, params.lr, params.trainer) == ("tiny:llama", 1e-5, "sft")


def test_python_api_errors_are_one_line():
    from rl import AutoTrainProject, LLMTrainingParams

    params = LLMTrainingParams(model="tiny:llama", trainer="sft")
    with pytest.raises(ValueError, match="backend='spaces-a10g-large' is not supported: only 'local'"):
        AutoTrainProject(params=params, backend="spaces-a10g-large", process=True)
    with pytest.raises(ValueError, match=r"LLMTrainingParams\(trainer='sft'\): --rl-gamma has no meaning"):
        LLMTrainingParams(model="tiny:llama", trainer="sft", rl_gamma=0.9)
    with pytest.raises(ConfigError, match="unknown key 'max_stepz' \\(did you mean max_steps\\?\\)"):
        LLMTrainingParams(model="tiny:llama", trainer="sft", max_stepz=2)
    with pytest.raises(ConfigError, match="key 'per_device_train_batch_size' has value 'four', expected int"):
        LLMTrainingParams(model="tiny:llama", trainer="sft", batch_size="four")
    with pytest.raises(ValueError, match="trainer='orpo' is unknown; choose one of sft, reward, dpo, ppo, grpo"):
        LLMTrainingParams(model="tiny:llama", trainer="orpo")


@pytest.mark.slow
def test_python_api_trains_sft(tmp_path, monkeypatch):
    """AutoTrainProject(...).create() runs launch/sft.py to the end (2 steps) and saves the model."""
    from rl import AutoTrainProject, LLMTrainingParams

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "sft-model"
    params = LLMTrainingParams(model="tiny:llama", data_path=str(ROOT / "data/tiny/sft_arith.jsonl"),
                               project_name=str(out), trainer="sft", epochs=1, batch_size=16, lr=3e-3,
                               max_steps=2, report_to=["jsonl"])
    assert AutoTrainProject(params=params, backend="local", process=True).create() == out
    assert (out / "model.safetensors").exists()
    failing = LLMTrainingParams(model="tiny:llama", data_path=str(tmp_path / "missing.jsonl"), trainer="sft")
    with pytest.raises(RuntimeError, match="sft training exited with status 2"):
        AutoTrainProject(params=failing, backend="local", process=True).create()


@pytest.mark.slow
def test_python_api_ppo_example_runs(tmp_path, monkeypatch):
    """The doc's snippet as written, in a directory with ./prompts.jsonl and ./reward-model. The file holds
    8 of the tiny prompts: the snippet's one epoch at batch 4 is then 2 PPO iterations (all 64 made 16)."""
    from rl.models.tiny import write_tiny_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    rows = (ROOT / "data/tiny/ppo_prompts.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "prompts.jsonl").write_text("".join(rows[:8]))
    write_tiny_model(tmp_path / "reward-model", family="gemma", task="classifier")
    run_doc(PYTHON_API, {}, {**API_IMPORTS, '"google/gemma-3-270m"': '"tiny:gemma"'})
    assert (tmp_path / "ppo-model" / "model.safetensors").exists()


# ------------------------------------------------------ ppo-cli-docs: --rl-chunk-size, --rl-optimize-device-cache

DOC_MEMORY_FLAGS = ["--rl-chunk-size", "128", "--rl-optimize-device-cache"]


def test_memory_flags_translate_to_recipe_keys():
    """15.4: the mapping itself, independent of which schema knows the keys yet."""
    from rl.scripts.cli import translate

    assert translate("ppo", DOC_MEMORY_FLAGS, schema=None) == \
        ["--logprob_chunk_size", "128", "--optimize_device_cache", "true"]
    assert translate("ppo", ["--rl-optimize-device-cache", "False"], schema=None) == \
        ["--optimize_device_cache", "False"]


def test_memory_flags_reach_the_ppo_config():
    from rl.config.parse import parse_config
    from rl.scripts.cli import _schema, translate

    args = translate("ppo", DOC_MEMORY_FLAGS, _schema("ppo"))
    cfg = parse_config(_schema("ppo"), ["--model", "tiny:llama", *args])
    assert (cfg.logprob_chunk_size, cfg.optimize_device_cache) == (128, True)


# ------------------------------------------------------------------ rl-module-docs: "Treinamento PPO"

PPO_DOC = '''
from autotrain.trainers.rl import PPOConfig, PPOTrainer

config = PPOConfig(
    model_name="google/gemma-2-2b",
    learning_rate=1e-5,
    batch_size=16,
    mini_batch_size=4,
    gradient_accumulation_steps=1,

    # PPO hyperparameters
    ppo_epochs=4,
    gamma=0.99,           # Discount factor
    lam=0.95,             # GAE lambda
    clip_ratio=0.2,       # PPO clip ratio
    value_clip=0.2,       # Value function clip
    max_grad_norm=1.0,    # Gradient clipping

    # KL penalty
    kl_penalty_coef=0.01,
    kl_target=0.01,
    kl_horizon=10000,     # Horizon for adaptive KL

    # Coefficients
    entropy_coef=0.01,    # Entropy regularization
    value_coef=0.5,       # Value function coefficient

    # Generation
    max_new_tokens=128,
    temperature=0.7,
    top_p=0.9,

    # Training loop
    num_iterations=100,
    save_every=10,
    eval_every=5,
    device=None,          # Auto-detected
)

# Initialize trainer with custom reward function
def my_reward_fn(prompts, responses, metadata=None):
    rewards = []
    for response in responses:
        score = evaluate_response(response)
        rewards.append(score)
    return rewards

trainer = PPOTrainer(
    config=config,
    tokenizer=tokenizer,  # Optional, loaded from model if not provided
    reward_fn=my_reward_fn,
)

# Train on prompts
prompts = ["Write a poem about...", "Explain quantum..."]
metrics = trainer.train(prompts, num_iterations=100)
'''


def test_ppo_example_keeps_the_reference_meanings_and_trains_without_a_warning(tiny_tokenizer, tmp_path, monkeypatch,
                                                                                capsys):
    """The doc's PPOConfig block and training loop, verbatim but for the model (a tiny one) and the run's length
    (100 rounds -> 1, in both places): ppo_epochs=4 passes over 16 rollouts in minibatches of 4 are 16 optimizer
    steps in one round; num_iterations is the rounds, in the config and in train(); no warning of any kind (the
    module runs with warnings as errors) and no deprecation line."""
    monkeypatch.chdir(tmp_path)
    ns = run_doc(PPO_DOC, {"tokenizer": tiny_tokenizer, "evaluate_response": lambda r: r.count("a") / 10},
                 {'"google/gemma-2-2b"': '"tiny:llama"', "num_iterations=100": "num_iterations=1",
                  "device=None,": 'device=None, report_to=["none"],'})
    cfg, metrics = ns["config"], ns["metrics"]
    assert (cfg.num_iterations, cfg.num_ppo_epochs, cfg.ppo_epochs, cfg.per_device_train_batch_size) == (1, 4, 4, 16)
    assert (cfg.epsilon, cfg.beta, cfg.vf_coef, cfg.max_completion_length, cfg.save_steps, cfg.eval_steps) == \
        (0.2, 0.01, 0.5, 128, 10, 5)
    assert [m["step"] for m in metrics] == list(range(1, 17)) and {m["iteration"] for m in metrics} == {1}
    out, err = capsys.readouterr()  # on stdout too (the console's notes); DeepSpeed's own CPU-accelerator line aside
    ours = [line for line in (out + err).splitlines() if line.lower().startswith("warning") or "deprecat" in line]
    assert not ours, out + err


# ------------------------------------------------------------------ rl-module-docs: "Treinamento DPO"

DPO_DOC = '''
from autotrain.trainers.rl import DPOConfig, DPOTrainer

config = DPOConfig(
    model_name="google/gemma-2-2b",
    learning_rate=1e-6,
    batch_size=8,
    gradient_accumulation_steps=2,

    # DPO hyperparameters
    beta=0.1,              # Temperature parameter
    label_smoothing=0.0,   # For robustness
    reference_free=False,  # Use reference model

    # Training
    num_epochs=1,
    max_grad_norm=1.0,
    warmup_ratio=0.1,

    # Sequence lengths
    max_length=512,
    max_prompt_length=256,

    # Checkpointing
    eval_every=100,
    save_every=500,
    device=None,           # Auto-detected
)

from autotrain.trainers.rl.dpo import PreferenceDataset

# Create dataset from preference pairs
dataset = PreferenceDataset(
    prompts=["What is AI?", "Explain gravity"],
    chosen=["AI is artificial intelligence...", "Gravity is a force..."],
    rejected=["idk lol", "its like magnets"],
    tokenizer=tokenizer,
    max_length=512,
    max_prompt_length=256,
)

# Train
trainer = DPOTrainer(config=config, tokenizer=tokenizer)
metrics = trainer.train(dataset, eval_dataset=eval_dataset)
'''


def test_dpo_example_trains_two_pairs_with_a_global_batch_of_sixteen(tiny_tokenizer, tmp_path, monkeypatch, caplog):
    """2 pairs, batch_size=8 x gradient_accumulation_steps=2: one short step on the data there is, with one
    warning, instead of 'fewer than one global batch' (the doc leaves tokenizer and eval_dataset to the reader)."""
    monkeypatch.chdir(tmp_path)
    ns = run_doc(DPO_DOC, {"tokenizer": tiny_tokenizer, "eval_dataset": None},
                 {'"google/gemma-2-2b"': '"tiny:llama"', "device=None,": 'device=None, report_to=["none"],'})
    metrics = ns["metrics"]
    assert len(metrics) == 1 and metrics[0]["step"] == 1
    assert metrics[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # policy == reference at the first step


def test_the_python_api_refuses_to_mix_two_runs_in_one_directory(tmp_path, tiny_llama, tiny_tokenizer):
    """The README's `XTrainer(...).train(...)` run twice into one output_dir: the second run is one RunError
    (as the launch scripts' rule: resume or overwrite), nothing of the first run is touched; with
    overwrite=true it replaces the first run, so metrics.jsonl never holds two runs' steps."""
    import json

    from rl.config.fields import build
    from rl.errors import RunError
    from rl.trainers.sft import SFTConfig, SFTTrainer

    cfg = dict(model_name=tiny_llama, output_dir=str(tmp_path), report_to=["jsonl"], max_steps=2, batch_size=2,
               log_every=1, max_length=32)
    examples = [{"input_ids": [1, 5, 6, 7], "labels": [-100, 5, 6, 7]}] * 4
    SFTTrainer(build(SFTConfig, cfg), tokenizer=tiny_tokenizer).train(examples)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RunError, match="holds a previous run"):
        SFTTrainer(build(SFTConfig, cfg), tokenizer=tiny_tokenizer).train(examples)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    SFTTrainer(build(SFTConfig, {**cfg, "overwrite": True}), tokenizer=tiny_tokenizer).train(examples)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
