"""The vLLM tier: the engine for real (vLLM's CPU build here), checked against our trainer and sampler.

Runs where vLLM imports (`.ci/run` makes a venv of its own for it: vLLM pins its own transformers) and is
skipped elsewhere, unless RL_REQUIRE_VLLM=1 (CI's tier), where a missing vLLM fails. The in-process tests
share one colocated engine (rl.rollout.vllm_engine caches it per model shape: the same tiny model and
max_length everywhere here), since an engine start costs ~50-100 s on 2 cores.

What is checked (issue: vLLM as the rollout engine):
* the engine's log-probs of its own samples equal our recompute of the same tokens (max |delta| printed);
* after one optimizer step and a sync the engine's log-probs are the updated policy's and not the old
  one's: full fine-tune, LoRA (merged weights), server mode (weights over a gloo group), and ZeRO-3 with
  2 processes (each rank's engine, weights gathered a module at a time);
* GRPO with use_vllm learns the tiny task as our sampler does;
* a server that dies mid-run stops the next sync or sample with one line.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, accelerate_cmd, run_cmd

if os.environ.get("RL_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (the vllm tier runs in .ci/run's vLLM venv)")

pytestmark = pytest.mark.vllm

MAX_LENGTH = 32  # every trainer here: one engine shape, so one engine for the session


@pytest.fixture(scope="session")
def hd64(tiny_cache):
    from rl.models.sources import resolve_model_path

    return resolve_model_path("tiny:llama-hd64")


def grpo(hd64, tmp_path, reward, **over):
    from rl.config.parse import build
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig

    cfg = build(GRPOConfig, {**dict(model_name="tiny:llama-hd64", output_dir=str(tmp_path), learning_rate=1e-2,
                                    lr_scheduler_type="constant", per_device_train_batch_size=16, num_generations=4,
                                    max_completion_length=4, max_length=MAX_LENGTH, max_steps=2, report_to=["jsonl"],
                                    seed=0, use_vllm=True), **over})
    rows = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]
    return GRPOTrainer(cfg, reward_funcs=[reward], train_prompts=rows)


def digit_first(prompts, completions, **kw):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


from tests.integration.vllm_rewards import spread  # noqa: E402 - distinct completions, distinct rewards: every group moves


def engine_vs_policy(trainer, model_before) -> tuple[float, float]:
    """Sample with the trainer's engine (synced to its current step), score the samples with the current
    policy and with `model_before`: (max |engine - current|, mean |engine - before|) over sampled tokens."""
    from rl.engine.scoring import sequence_logprobs
    from rl.rollout.prompts import encode_prompt
    from rl.trainers.sampling import rollout_sampler

    prompts = [encode_prompt(trainer.tokenizer, f"{a}+{a}=", 16, False) for a in range(6)]
    roll = rollout_sampler(trainer, None)(trainer.pipeline.model, trainer.tokenizer, prompts, max_new_tokens=6,
                                    num_samples=2)
    batch = roll.to_batch()
    m = batch["labels"][:, 1:].ne(-100)
    now = trainer.pipeline.unwrapped_model
    lp_now = sequence_logprobs(now, batch["input_ids"], batch["attention_mask"], batch["labels"])[0]
    lp_old = sequence_logprobs(model_before, batch["input_ids"], batch["attention_mask"], batch["labels"])[0]
    engine = batch["old_logprobs"]
    return float((engine - lp_now).abs()[m].max()), float((engine - lp_old).abs()[m].mean())


def colocated(model_dir, **over):
    """A VLLMRollout on the session's shared engine (the trainers' engine settings: one engine for the session)."""
    from types import SimpleNamespace

    from rl.rollout.vllm_engine import VLLMRollout

    cfg = SimpleNamespace(**{**dict(vllm_mode="colocate", vllm_weight_sync_bucket_mb=512, vllm_enable_sleep_mode=False,
                                    vllm_sync_lora_adapters=False,
                                    vllm_tensor_parallel_size=1, dtype="float32", max_length=MAX_LENGTH,
                                    vllm_gpu_memory_utilization=0.3, seed=0, verbose=False), **over})
    acc = SimpleNamespace(process_index=0, local_process_index=0, num_processes=1, is_main_process=True)
    return VLLMRollout(cfg, acc, model_dir)


def test_engine_logprobs_equal_our_recompute(hd64):
    from transformers import AutoModelForCausalLM

    from rl.engine.scoring import sequence_logprobs
    from rl.models.loading import load_tokenizer

    tok = load_tokenizer(hd64)
    model = AutoModelForCausalLM.from_pretrained(hd64, dtype=torch.float32)
    eng = colocated(hd64)
    eng.sync(model, -1)  # an engine shared with other tests: this model's weights
    prompts = [tok(f"{a}*{b}=")["input_ids"] for a in range(4) for b in range(2)]
    roll = eng.generate(None, tok, prompts, max_new_tokens=12, temperature=1.0, num_samples=4, seed=11)
    assert roll.tokens.shape[0] == 32 and roll.mask.sum() > 32
    # seeded: row r of the call samples from seed 11 + r, whatever the batch (the rows of prompt 5 alone)
    again = eng.generate(None, tok, prompts[5:6], max_new_tokens=12, temperature=1.0, num_samples=4, seed=11 + 5 * 4)
    assert torch.equal(again.tokens, roll.tokens[20:24, :again.tokens.shape[1]])
    batch = roll.to_batch()
    lp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["labels"])[0]
    m = batch["labels"][:, 1:].ne(-100)
    delta = (batch["old_logprobs"] - lp).abs()[m]
    print(f"tiny hd64: {int(m.sum())} tokens, max |engine - ours| {delta.max():.2e}, mean {delta.mean():.2e}")
    assert delta.max() < 1e-4
    # temperature and top-k: the engine's log-probs are of the distribution it drew from (processed)
    roll = eng.generate(None, tok, prompts, max_new_tokens=8, temperature=0.7, top_k=20, num_samples=2)
    batch = roll.to_batch()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1] / 0.7
    kth = logits.topk(20, dim=-1).values[..., -1:]
    logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
    labels = batch["labels"][:, 1:]
    m = labels.ne(-100)
    ours = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert (batch["old_logprobs"] - ours).abs()[m].max() < 1e-4


@pytest.mark.parametrize("sync", ["full", "lora", "lora_adapters"])
def test_after_a_step_the_engine_holds_the_updated_policy(hd64, tmp_path, sync):
    """Colocated: full weights; LoRA merged into them; LoRA adapters alone, applied by vLLM's LoRA support (an
    engine of its own: LoRA enabled)."""
    lora = {"lora": {"enabled": True, "rank": 4, "alpha": 8, "dropout": 0.0}}
    over = {"full": {}, "lora": lora, "lora_adapters": {**lora, "vllm_sync_lora_adapters": True}}[sync]
    t = grpo(hd64, tmp_path, spread, max_steps=1, **over)
    t.train()
    before = copy.deepcopy(t.pipeline.unwrapped_model)
    # one more optimizer step, by hand: the engine must follow it at the next rollout
    t.cfg.max_steps = 2
    t._plan["total_steps"] = 2
    t.train_step()
    now_gap, old_gap = engine_vs_policy(t, before)
    print(f"{sync}: max |engine - updated| {now_gap:.2e}, mean |engine - old| {old_gap:.2e}")
    assert now_gap < 1e-4 and old_gap > 1e-3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "sampling/sampling_logp_difference/max" in r]
    assert logged and all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in logged)
    assert all(r["sampling/importance_sampling_ratio/clipped_frac"] == 0.0 for r in logged)


def test_grpo_with_vllm_learns_like_our_sampler(hd64, tmp_path):
    """The digit-first task of test_grpo.py's beta-0 test, on the head_dim-64 tiny model, 12 steps: the
    reward gain (mean of the last 3 steps minus the first 3) clears 0.2 with vLLM and with our sampler."""
    gains = {}
    for use_vllm in (True, False):
        t = grpo(hd64, tmp_path / str(use_vllm), digit_first, per_device_train_batch_size=32, gradient_accumulation_steps=2,
                 num_generations=8, max_completion_length=3, max_steps=12, use_vllm=use_vllm)
        h = t.train()
        gains[use_vllm] = sum(r["reward"] for r in h[-3:]) / 3 - sum(r["reward"] for r in h[:3]) / 3
    print(f"reward gain over 12 steps: vLLM {gains[True]:+.3f}, our sampler {gains[False]:+.3f}")
    assert gains[True] > 0.2 and gains[False] > 0.2, gains


def test_ppo_logs_the_mismatch_of_vllms_samples(hd64, tmp_path):
    """PPO with use_vllm: its rollouts come from the engine, the mismatch metrics (TRL's names) are logged and the
    correction's weights are those of an engine that holds the policy (ratio 1 to 1e-4). top_k=0: PPO's documented
    top_k 50 truncates the sampling distribution, which the engine's log-probs measure and the policy's do not."""
    from rl.trainers.ppo import PPOConfig, PPOTrainer

    cfg = PPOConfig(model_name="tiny:llama-hd64", output_dir=str(tmp_path), seed=0, learning_rate=1e-2,
                    per_device_train_batch_size=8, mini_batch_size=8, num_iterations=2, num_ppo_epochs=1,
                    max_completion_length=4, max_length=MAX_LENGTH, dtype="float32", report_to=["jsonl"],
                    logging_steps=1, use_vllm=True, top_k=0)
    t = PPOTrainer(cfg, reward_fn=lambda p, r, m=None: [float(sum(map(ord, x)) % 7) for x in r])
    t.train([f"{a}+{a}=" for a in range(8)])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "sampling/sampling_logp_difference/max" in r]
    print("ppo: max |engine - policy| per step", [f"{r['sampling/sampling_logp_difference/max']:.1e}" for r in logged])
    assert len(logged) == 2 and all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in logged)
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for r in logged)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    """One `rl vllm-serve` for the module's server tests (the last of them kills it); --verbose: its log has a
    line per generate call."""
    port, group = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "rl.rollout.vllm_server", "--model", "tiny:llama-hd64", "--host",
                             "127.0.0.1", "--port", str(port), "--group-port", str(group), "--max-model-len",
                             str(MAX_LENGTH), "--verbose"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield proc, port, group, path
    proc.kill()
    proc.wait(30)
    log.close()
    if proc.returncode not in (0, -9):
        print(path.read_text()[-3000:])


@pytest.mark.parametrize("bucket_mb", [512, 0], ids=["buckets", "per_tensor"])
def test_server_mode_syncs(hd64, tmp_path, server, bucket_mb):
    """After a step the server's engine holds the updated policy, its weights sent in 512 MiB buckets (the default)
    or one tensor at a time."""
    proc, port, group, _ = server
    t = grpo(hd64, tmp_path, spread, max_steps=1, vllm_mode="server", vllm_server_port=port,
             vllm_group_port=group, vllm_server_timeout=300.0, vllm_weight_sync_bucket_mb=bucket_mb)
    t.train()
    before = copy.deepcopy(t.pipeline.unwrapped_model)
    t._plan["total_steps"] = t.cfg.max_steps = 2
    t.train_step()
    now_gap, old_gap = engine_vs_policy(t, before)
    print(f"server ({bucket_mb} MiB): max |engine - updated| {now_gap:.2e}, mean |engine - old| {old_gap:.2e}")
    assert now_gap < 1e-4 and old_gap > 1e-3


def test_two_training_processes_one_server_one_call_per_step(tmp_path, server):
    """A GRPO step of 2 training processes (accelerate launch, gloo) through one server makes one /generate call
    (both processes' prompts), and draws exactly the completions of the 1-process run of the same global batch
    (row r of the step samples from the same seed wherever it runs)."""
    proc, port, group, log = server
    common = ["--config", "recipes/tiny/grpo.yaml", "model_name=tiny:llama-hd64", "use_vllm=true", "vllm_mode=server",
              f"vllm_server_port={port}", f"vllm_group_port={group}", "max_steps=1", f"max_length={MAX_LENGTH}",
              "num_generations=4", "max_completion_length=6", "eval_steps=0", "eval_num_prompts=4",
              "reward_funcs=[tests.integration.vllm_rewards:record]", "vllm_server_timeout=300"]
    seen = {}
    for name, cmd in (("two", accelerate_cmd("launch/grpo.py", *common, "per_device_train_batch_size=8")),
                      ("one", [sys.executable, "launch/grpo.py", *common, "per_device_train_batch_size=16"])):
        rec = tmp_path / f"rec-{name}"
        rec.mkdir()
        mark = len(log.read_text().splitlines())
        run_cmd(cmd + [f"output_dir={tmp_path / name}"], timeout=900,
                env={"RL_NO_PROGRESS": "1", "RL_RECORD_DIR": str(rec)})
        calls = [line for line in log.read_text().splitlines()[mark:] if "generate:" in line]
        seen[name] = sorted(tuple(json.loads(line)) for f in rec.iterdir() for line in f.read_text().splitlines())
        print(name, "process(es):", calls)
        assert len(calls) == 1 and "4 prompts, 16 completions" in calls[0], calls
    assert len(seen["two"]) == 16 and seen["two"] == seen["one"]
    assert len({c for _, c in seen["one"]}) > 4  # samples, not one greedy answer per prompt


@pytest.mark.slow
def test_tensor_parallel_two_processes_share_one_engine(tmp_path):
    """vllm_tensor_parallel_size=2 on 2 CPU processes: one engine sharded over both (vLLM's external launcher
    on the launch's gloo group); after each sync its log-probs are the updated policy's. Its shared-memory
    segments are gone at exit (one left behind made the next TP run on the machine fail)."""
    out = tmp_path / "tp"
    shm = set(os.listdir("/dev/shm"))
    run_cmd(accelerate_cmd("launch/grpo.py", "--config", "recipes/tiny/grpo.yaml", f"output_dir={out}",
                           "model_name=tiny:llama-hd64", "use_vllm=true", "vllm_tensor_parallel_size=2", "max_steps=2",
                           "per_device_train_batch_size=16", f"max_length={MAX_LENGTH}", "eval_steps=0",
                           "learning_rate=1e-2", "reward_funcs=[tests.integration.vllm_rewards:spread]"),
            timeout=900, env={"RL_NO_PROGRESS": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "sampling/sampling_logp_difference/max" in r]
    print("tp=2: max |engine - policy| per step", [f"{r['sampling/sampling_logp_difference/max']:.1e}" for r in train])
    assert [r["step"] for r in train] == [1, 2] and all(r["grad_norm"] > 0 for r in train)
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in train), train
    assert not [n for n in set(os.listdir("/dev/shm")) - shm if "cpushm" in n]


def test_a_dead_server_is_one_line(hd64, tmp_path, server):
    from rl.errors import RunError

    proc, port, group, _ = server
    t = grpo(hd64, tmp_path, spread, max_steps=1, vllm_mode="server", vllm_server_port=port,
             vllm_group_port=group, vllm_server_timeout=300.0)
    t.train()
    proc.kill()
    proc.wait(30)
    t._plan["total_steps"] = t.cfg.max_steps = 2
    t._vllm.client.timeout = 10.0  # every request's bound: a server that is gone cannot hang the run
    with pytest.raises(RunError, match="vLLM server at http://127.0.0.1") as e:
        t.train_step()  # its sync (or rollout) asks a server that is gone
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_zero3_two_processes_sync_gathered_weights(tmp_path):
    out = tmp_path / "z3"
    run_cmd(accelerate_cmd("launch/grpo.py", "--config", "recipes/tiny/grpo.yaml", f"output_dir={out}",
                           "model_name=tiny:llama-hd64", "use_vllm=true", "max_steps=3", "per_device_train_batch_size=16",
                           f"max_length={MAX_LENGTH}", "eval_steps=0", "eval_num_prompts=4", "learning_rate=1e-2",
                           "reward_funcs=[tests.integration.vllm_rewards:spread]", zero3=True), timeout=900, env={"RL_NO_PROGRESS": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "sampling/sampling_logp_difference/max" in r]
    print("zero3 2 processes: max |engine - policy| per step",
          [f"{r['sampling/sampling_logp_difference/max']:.1e}" for r in train], "grad norms",
          [round(r["grad_norm"], 3) for r in train])
    assert [r["step"] for r in train] == [1, 2, 3]
    # steps 2 and 3 sampled after syncs of gathered weights: the engines' log-probs are the policy's
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in train), train
    assert all(r["grad_norm"] > 0 for r in train)  # the policy moved, so a missed sync would show
    assert (out / "model.safetensors").exists()


def test_the_trl_grpo_recipe_trains_with_vllm_with_only_the_model_and_data_overridden(tmp_path):
    """Issue 46's recipe (tests/data/trl/grpo_qwen7b.yaml: use_vllm true, bf16, push_to_hub) with vLLM installed:
    only model_name_or_path (the tiny model with head_dim 64, what vLLM's CPU attention takes) and dataset_name
    are given; the colocated bf16 engine samples against the fp32 trainer, the hub call is recorded
    (tests/integration/test_trl_recipes.py)."""
    from tests.integration.test_trl_recipes import DATA, GRPO, _final_metrics, _train

    log, calls = _train("grpo", ["--config", str(GRPO), "model_name_or_path=tiny:qwen2-hd64",
                                 f"dataset_name={DATA / 'numina_tiny.jsonl'}"], tmp_path)
    assert "grpo done: 1 steps" in log and [c[0] for c in calls][-1] == "upload_folder", log[-3000:]
    metrics = _final_metrics(tmp_path / "data/Qwen2.5-7B-Instruct-GRPO/README.md")  # report_to: wandb, no jsonl
    assert metrics["sampling/sampling_logp_difference/max"] < 0.1, metrics  # a bf16 engine against the fp32 trainer
