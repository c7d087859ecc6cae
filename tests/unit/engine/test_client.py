"""AsyncTrainingClient: ordered futures, exceptions, sampling/forward agreement, reference model,
checkpoints, and a 2-process ZeRO-3 CPU run."""

from __future__ import annotations

import json
import textwrap
import threading
import time

import pytest
import torch

from tests.conftest import accelerate_cmd, run_cmd


def _model(path):
    from rl.models.loading import load_causal_lm

    return load_causal_lm(path, dtype="float32")


def _client(path, tokenizer=None, reference=False, gas=1, **kw):
    from rl.engine.client import AsyncTrainingClient

    model = _model(path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = _model(path) if reference else None
    return AsyncTrainingClient(model, reference_model=ref, device="cpu", gradient_accumulation_steps=gas,
                               optimizer=opt, tokenizer=tokenizer, **kw)


def _batch(tok, texts=("hello there", "general")):
    ids = [tok.encode(t) for t in texts]
    T = max(map(len, ids))
    input_ids = torch.full((len(ids), T), tok.pad_token_id)
    mask = torch.zeros(len(ids), T, dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def test_importable_from_rl_and_module():
    import rl
    from rl.engine.client import AsyncTrainingClient

    assert rl.AsyncTrainingClient is AsyncTrainingClient


def test_requests_run_in_submission_order(tiny_llama, tiny_tokenizer):
    """Everything is submitted before any result is read. A slow loss makes each forward_backward
    take long: with two workers the optim_step would start before its micro-batch finished and
    fail ("optim_step after 0 forward_backward calls"), and the event log would interleave."""
    client = _client(tiny_llama, max_workers=4)  # the reference's knob: must not create a race
    events, lock = [], threading.Lock()
    from rl.engine.losses import LOSS_FNS

    def slow_ce(i):
        def fn(logits, labels, mask, **kw):
            with lock:
                events.append(("start", i))
            time.sleep(0.05)
            with lock:
                events.append(("end", i))
            return LOSS_FNS["cross_entropy"](logits, labels, mask)
        return fn

    batch = _batch(tiny_tokenizer)
    futures = []
    for i in range(4):
        futures.append(client.forward_backward(batch, loss_fn=slow_ce(i)))
        futures.append(client.optim_step())
    results = [f.result(timeout=120) for f in futures]
    assert [r.step for r in results[1::2]] == [1, 2, 3, 4]
    assert events == [(k, i) for i in range(4) for k in ("start", "end")]
    # losses went down: every optim_step saw the gradients of the micro-batch before it
    losses = [r.loss for r in results[0::2]]
    assert losses[-1] < losses[0]
    client.shutdown()


def test_exception_surfaces_in_result_and_client_stays_usable(tiny_llama, tiny_tokenizer):
    client = _client(tiny_llama)
    batch = _batch(tiny_tokenizer)
    bad = client.forward_backward(batch, loss_fn="ppo", advantages=torch.ones(2))  # no old_logprobs
    good = client.forward_backward(batch)
    step = client.optim_step()
    with pytest.raises(ValueError, match="old_logprobs"):
        bad.result(timeout=60)
    assert good.result(timeout=60).loss > 0 and step.result(timeout=60).step == 1
    with pytest.raises(KeyError, match="unknown loss_fn"):
        client.forward_backward(batch, loss_fn="nope").result(timeout=60)
    with pytest.raises(ValueError, match="reference_model"):
        client.forward(batch, use_reference=True).result(timeout=60)
    assert client.forward(batch).result(timeout=60).outputs.shape == (2, batch["input_ids"].shape[1] - 1)
    client.shutdown()


def test_unread_failure_is_raised_at_shutdown_and_logged(tiny_llama, tiny_tokenizer, caplog):
    """The reference docs never read `optim_future`: a failure there must not vanish."""
    import logging

    client = _client(tiny_llama)
    client.pipeline.optimizer = None  # the optimizer is missing: optim_step fails
    client.forward_backward(_batch(tiny_tokenizer))
    client.optim_step()  # nobody reads it
    read = client.forward_backward({"input_ids": torch.ones(1, 3, dtype=torch.long)}, loss_fn="nope")
    with pytest.raises(KeyError):
        read.result(timeout=60)  # read: not reported again
    with caplog.at_level(logging.ERROR, logger="rl.engine"):
        with pytest.raises(RuntimeError, match="1 request.* never read .tracebacks logged.; the first, "
                                               "optim_step: ValueError: optim_step needs an optimizer"):
            client.shutdown()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == \
        ["engine request optim_step failed and its future was never read"]
    assert "Traceback" in caplog.records[0].getMessage() and "in _optim_step" in caplog.records[0].getMessage()
    client.shutdown()  # reported once: a second shutdown is quiet


def test_sample_logprobs_equal_later_forward(tiny_llama, tiny_tokenizer):
    client = _client(tiny_llama, tokenizer=tiny_tokenizer)
    prompt = tiny_tokenizer.encode("once upon")
    s = client.sample(prompt, max_tokens=12, temperature=1.0, seed=4)
    assert s["prompt"] == prompt and len(s["tokens"]) == len(s["logprobs"]) > 0  # reference-style access
    s = s.result()
    ids = torch.tensor([prompt + s["tokens"]])
    labels = ids.clone()
    labels[:, :len(prompt)] = -100
    fwd = client.forward({"input_ids": ids, "labels": labels}).result(timeout=60)
    got = fwd.outputs[0, len(prompt) - 1:]
    assert torch.allclose(got, torch.tensor(s["logprobs"]), atol=1e-4)
    # seeded sampling repeats; num_samples gives lists
    again = client.sample(torch.tensor(prompt), max_tokens=12, temperature=1.0, seed=4).result()
    assert again["tokens"] == s["tokens"]
    many = client.sample(prompt, max_tokens=5, num_samples=3, seed=0, stop=["\n", 10]).result()
    assert len(many["tokens"]) == 3 and all(len(t) == len(lp) for t, lp in zip(many["tokens"], many["logprobs"]))
    client.shutdown()


def test_rl_step_on_a_rollout_with_reference(tiny_llama, tiny_tokenizer):
    """sample_batch -> forward(reference) -> ppo forward_backward -> optim_step; the reference stays
    frozen while the policy moves, and the policy's first PPO ratio is exactly 1.

    The advantages are both positive so that the importance-sampling loss cannot cancel to 0 whatever
    the sampler draws: with +1/-1 it is exactly 0 when both completions have the same length (seen on
    another CPU, where both ran to the full 8 tokens)."""
    client = _client(tiny_llama, tokenizer=tiny_tokenizer, reference=True, gas=2)
    prompts = [tiny_tokenizer.encode(t) for t in ("ab", "a longer prompt")]
    roll = client.sample_batch(prompts, max_new_tokens=8, seed=0).result(timeout=60)
    batch = roll.to_batch()
    ref0 = client.forward(batch, use_reference=True).result(timeout=60).outputs
    adv = torch.tensor([1.0, 0.5])
    f1 = client.forward_backward({**batch, "advantages": adv}, loss_fn="ppo", epsilon=0.2, epsilon_high=0.28)
    f2 = client.forward_backward(batch, loss_fn="importance_sampling", advantages=adv)
    st = client.optim_step(max_grad_norm=1.0).result(timeout=60)
    m = f1.result().metrics
    assert m["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["policy/clipfrac"] == 0.0
    assert f2.result().loss < 0 and st.grad_norm > 0  # -(ratio * A) token mean, ratio ~1, A > 0
    ref1 = client.forward(batch, use_reference=True).result(timeout=60).outputs
    pol1 = client.forward(batch).result(timeout=60).outputs
    assert torch.equal(ref0, ref1)
    assert not torch.allclose(pol1, ref1, atol=1e-4)
    client.shutdown()


def test_save_and_load_state(tiny_llama, tiny_tokenizer, tmp_path):
    client = _client(tiny_llama, checkpoint_dir=tmp_path)
    batch = _batch(tiny_tokenizer)
    client.forward_backward(batch)
    client.optim_step()
    info = client.save_state("ck", {"note": 1}).result(timeout=60)  # the client keeps its futures
    before = client.forward(batch).result().outputs
    client.forward_backward(batch)
    client.optim_step()
    moved = client.forward(batch).result().outputs
    assert client.load_state(info["path"]).result(timeout=60) == {"note": 1}
    after = client.forward(batch).result().outputs
    assert not torch.allclose(before, moved) and torch.allclose(before, after) and client.step == 1
    client.shutdown()


ZERO3_SCRIPT = textwrap.dedent('''
    import json, sys, torch, deepspeed
    
    from rl.engine.client import AsyncTrainingClient
    from rl.engine.dist import end_program, zero_stage
    from rl.models.loading import load_causal_lm, load_tokenizer

    path, out = sys.argv[1], sys.argv[2]
    calls = {"gather": 0}
    real = deepspeed.zero.GatheredParameters
    def counting(*a, **k):
        calls["gather"] += 1
        return real(*a, **k)
    deepspeed.zero.GatheredParameters = counting

    tok = load_tokenizer(path)
    model, ref = load_causal_lm(path, dtype="float32"), load_causal_lm(path, dtype="float32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    client = AsyncTrainingClient(model, reference_model=ref, gradient_accumulation_steps=1, optimizer=opt,
                                 tokenizer=tok, micro_batch_size=2)
    acc = client.accelerator
    rank = acc.process_index
    assert zero_stage(acc) == 3 and acc.num_processes == 2
    assert type(client.reference_model).__name__ == "DeepSpeedEngine"
    # each rank holds a shard of the reference
    shard = sum(p.ds_tensor.numel() for p in client.reference_model.module.parameters())
    full = sum(p.ds_numel for p in client.reference_model.module.parameters())
    # different prompts and lengths per rank: ranks finish their rollouts after different steps
    prompts = [tok.encode("ab" * (rank + 1)), tok.encode("hello" if rank == 0 else "a much longer prompt")]
    res = {"rank": rank, "shard": shard, "full": full, "losses": []}
    for step in range(2):
        before = calls["gather"]
        roll = client.sample_batch(prompts, max_new_tokens=6 + 4 * rank, seed=step).result()
        res.setdefault("gathers_per_rollout", []).append(calls["gather"] - before)
        batch = roll.to_batch()
        ref = client.forward(batch, use_reference=True).result().outputs
        pol = client.forward(batch).result().outputs
        adv = torch.tensor([1.0, -1.0])
        fb = client.forward_backward({**batch, "advantages": adv}, loss_fn="ppo").result()
        st = client.optim_step().result()
        res["losses"].append(fb.loss)
        res["ratio_mean"] = fb.metrics["policy/ratio_mean"]
        res["max_diff_sample_vs_forward"] = float(((pol - batch["old_logprobs"]) * (batch["labels"][:, 1:] != -100)).abs().max())
        res["step"] = st.step
    s = client.sample(tok.encode("hi"), max_tokens=5, seed=1).result()
    res["sample_len"] = len(s["tokens"])
    # the reference must not move while the policy trains: rescore the first rollout
    first = client.sample_batch(prompts, max_new_tokens=6 + 4 * rank, seed=0).result().to_batch()
    r_again = client.forward(first, use_reference=True).result().outputs
    p_again = client.forward(first).result().outputs
    res["ref_vs_policy_diff"] = float((r_again - p_again).abs().max())
    client.shutdown()
    json.dump(res, open(f"{out}/rank{rank}.json", "w"))
    end_program()  # as a launched program ends (docs/operations.md): no abort in the interpreter's teardown
''')


@pytest.mark.slow
def test_zero3_two_process_client(tiny_llama, tmp_path):
    script = tmp_path / "zero3_client.py"
    script.write_text(ZERO3_SCRIPT)
    run_cmd(accelerate_cmd(str(script), tiny_llama, str(tmp_path), zero3=True), timeout=600)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["step"] == 2 and r["sample_len"] > 0
        assert r["gathers_per_rollout"] == [1, 1]  # once per rollout, not per token
        assert r["shard"] < r["full"]  # the reference is sharded, not replicated
        assert r["max_diff_sample_vs_forward"] < 1e-4
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r["ref_vs_policy_diff"] > 1e-4  # the policy trained, the reference did not


def test_left_padded_rollout_scores_as_sampled_on_absolute_positions(tiny_cache, tiny_tokenizer):
    """GPT-2 has absolute positions: the first PPO ratio on a left-padded rollout is 1 only if
    forward_backward uses the same position ids as sampling."""
    from rl.engine.client import AsyncTrainingClient
    from rl.models.tiny import write_tiny_model

    model = _model(str(write_tiny_model(tiny_cache / "gpt2", family="gpt2")))
    for m in model.modules():  # RL training turns dropout off (else the first ratio is not 1)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    client = AsyncTrainingClient(model, device="cpu", optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 tokenizer=tiny_tokenizer)
    prompts = [tiny_tokenizer.encode(t) for t in ("a", "a much longer prompt")]
    batch = client.sample_batch(prompts, max_new_tokens=6, seed=1).result(timeout=60).to_batch()
    assert batch["attention_mask"][0, 0] == 0  # left-padded
    fb = client.forward_backward({**batch, "advantages": torch.ones(2)}, loss_fn="ppo").result(timeout=60)
    assert fb.metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert fb.metrics["policy/approx_kl"] < 1e-8
    client.shutdown()
