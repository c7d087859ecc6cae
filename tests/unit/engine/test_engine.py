"""ForwardBackwardPipeline: accumulation exactness, checkpoint round trips, misuse errors."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.engine.pipeline import ForwardBackwardPipeline
from rl.engine.state import COMPLETE_MARKER


def make(path, n_accum, lr=0.1, opt="sgd", ckpt=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = (torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=lr))
    return ForwardBackwardPipeline(model, device="cpu", gradient_accumulation_steps=n_accum,
                                   optimizer=optimizer, checkpoint_dir=ckpt or "checkpoints")


def batch(n=8, t=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, t), generator=g)


def params(pipe):
    return [p.detach().clone() for p in pipe.unwrapped_model.parameters()]


def test_accumulation_equals_one_big_batch(tiny_llama):
    ids = batch()
    one, four = make(tiny_llama, 1), make(tiny_llama, 4)
    for _ in range(3):
        one.forward_backward(ids).result()
        g1 = one.optim_step().result().grad_norm
        for chunk in ids.chunk(4):
            four.forward_backward(chunk).result()
        g4 = four.optim_step().result().grad_norm
        assert g1 == pytest.approx(g4, rel=1e-5)
    diff = max((a - b).abs().max().item() for a, b in zip(params(one), params(four)))
    assert diff < 1e-5
    # gradients were cleared after each step: a fourth step from equal params is equal again
    assert all(p.grad is None for p in one.unwrapped_model.parameters())


def test_accumulation_actually_changes_the_update(tiny_llama):
    """Guard against a test that cannot fail: 4 micro-batches without 1/N scaling would differ."""
    ids = batch()
    a = make(tiny_llama, 1)
    a.forward_backward(ids[:2]).result()
    a.optim_step().result()
    b = make(tiny_llama, 1)
    b.forward_backward(ids).result()
    b.optim_step().result()
    assert max((x - y).abs().max().item() for x, y in zip(params(a), params(b))) > 1e-4


def test_optim_step_needs_one_to_n_micro_batches(tiny_llama):
    """0 micro-batches (no gradient) and an (N+1)-th one (no optimizer step was asked for) are
    errors; 1..N are fine (see the partial-accumulation tests)."""
    pipe = make(tiny_llama, 2)
    with pytest.raises(RuntimeError, match="optim_step after 0 forward_backward calls since the last step"):
        pipe.optim_step().result()
    pipe.forward_backward(batch(2)).result()
    pipe.forward_backward(batch(2)).result()
    with pytest.raises(RuntimeError, match="call optim_step before the next forward_backward"):
        pipe.forward_backward(batch(2)).result()
    r = pipe.optim_step().result()  # still usable after the errors
    assert (r.step, r.metrics["num_micro_batches"]) == (1, 2)
    with pytest.raises(RuntimeError, match="after 0 forward_backward calls"):  # cleared by the step
        pipe.optim_step().result()


@pytest.mark.parametrize("k,n", [(1, 4), (2, 4)])
def test_partial_accumulation_equals_k_micro_batches(tiny_llama, k, n):
    """k of N micro-batches then optim_step == gradient_accumulation_steps=k on the same k, after
    one SGD step (the step applies their mean gradient, rescaled by N/k). Without the rescale the
    update would be k/N as large, which the size check below makes visible."""
    ids = batch(2 * k)
    partial, exact = make(tiny_llama, n), make(tiny_llama, k)
    start = params(exact)
    for chunk in ids.chunk(k):
        partial.forward_backward(chunk).result()
        exact.forward_backward(chunk).result()
    rp, re_ = partial.optim_step().result(), exact.optim_step().result()
    assert rp.metrics["num_micro_batches"] == k and re_.metrics["num_micro_batches"] == k
    assert rp.grad_norm == pytest.approx(re_.grad_norm, rel=1e-6)
    update = max((a - b).abs().max().item() for a, b in zip(start, params(exact)))
    assert update > 1e-3  # lr 0.1: a step that a missing N/k factor would shrink far beyond 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(params(partial), params(exact))) < 1e-6
    # the counter restarts: N more micro-batches are allowed after a partial step
    for chunk in batch(n).chunk(n):
        partial.forward_backward(chunk).result()
    assert partial.optim_step().result().metrics["num_micro_batches"] == n


def test_custom_loss_is_applied_by_the_next_step(tiny_llama):
    pipe = make(tiny_llama, 1)
    before = params(pipe)

    def loss_fn(model, inputs, outputs, scale):
        return outputs.logits.float().pow(2).mean() * scale

    r = pipe.forward_backward_custom(loss_fn, batch(2), scale=2.0).result()
    assert r.loss > 0
    pipe.optim_step().result()
    assert max((a - b).abs().max().item() for a, b in zip(before, params(pipe))) > 0


def test_save_load_round_trip_and_resume_equals_uninterrupted(tiny_llama, tmp_path):
    ids = batch()
    a = make(tiny_llama, 1, lr=1e-2, opt="adamw", ckpt=tmp_path / "a")
    for _ in range(2):
        a.forward_backward(ids).result()
        a.optim_step().result()
    info = a.save_state("ckpt", {"epoch": 3})  # blocking, a dict (as the reference docs show)
    assert set(info) == {"path", "model_path", "optimizer_path", "state_path"}
    saved_params, saved_opt = params(a), copy.deepcopy(a.optimizer.state_dict())
    for _ in range(2):
        a.forward_backward(ids).result()
        a.optim_step().result()
    uninterrupted = params(a)

    b = make(tiny_llama, 1, lr=1e-2, opt="adamw", ckpt=tmp_path / "a")
    assert b.load_state(info["path"]) == {"epoch": 3}
    assert all(torch.equal(x, y) for x, y in zip(saved_params, params(b)))  # bitwise
    loaded_opt = b.optimizer.state_dict()
    for k, st in saved_opt["state"].items():
        for name, t in st.items():
            assert torch.equal(t, loaded_opt["state"][k][name]), (k, name)
    assert b.step == 2
    for _ in range(2):
        b.forward_backward(ids).result()
        b.optim_step().result()
    assert all(torch.equal(x, y) for x, y in zip(uninterrupted, params(b)))


def test_interrupted_save_leaves_previous_checkpoint(tiny_llama, tmp_path, monkeypatch):
    pipe = make(tiny_llama, 1, ckpt=tmp_path)
    pipe.forward_backward(batch(2)).result()
    pipe.optim_step().result()
    first = pipe.save_state("ckpt")
    good = params(pipe)
    pipe.forward_backward(batch(2)).result()
    pipe.optim_step().result()

    import rl.engine.state as state  # the checkpoint writer looks the RNG helpers up there

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(state, "_py_rng_state", boom)  # fails after the model file, before the rename
    with pytest.raises(OSError):
        pipe.save_state("ckpt")
    assert (tmp_path / "ckpt" / COMPLETE_MARKER).exists()
    assert (tmp_path / ".tmp-ckpt").exists()  # the half-written one, never picked up
    monkeypatch.undo()
    pipe.load_state(first["path"])
    assert all(torch.equal(x, y) for x, y in zip(good, params(pipe)))


def test_forward_gives_masked_token_logprobs(tiny_llama):
    pipe = make(tiny_llama, 1)
    ids = batch(2, 6)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    out = pipe.forward(ids, mask).result().outputs
    assert out.shape == (2, 5)
    assert torch.all(out[1, 3:] == 0) and torch.all(out[0] < 0)
    logits = pipe.unwrapped_model(input_ids=ids, attention_mask=mask).logits
    ref = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert torch.allclose(out[0], ref, atol=1e-5)


@pytest.mark.parametrize("name", ["../../escaped", "../x", "a/b", "/tmp/abs", "a\\b", "..", ".", "", ".hidden",
                                  ".tmp-x", "x\0y"])
def test_checkpoint_name_is_one_path_component(tiny_llama, tmp_path, name):
    """No traversal: refused before anything is written, inside or outside checkpoint_dir."""
    root = tmp_path / "a" / "b"
    pipe = make(tiny_llama, 1, ckpt=root / "ckpts")
    with pytest.raises(ValueError, match="checkpoint name .* must be one path component"):
        pipe.save_state(name)
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == []  # nothing at all
    assert pipe.save_state("ok-1")["path"] == str(root / "ckpts" / "ok-1")  # a plain name still saves


def test_client_refuses_a_traversing_name_before_queueing(tiny_llama, tmp_path):
    from rl.engine.client import AsyncTrainingClient
    from rl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_llama, dtype="float32")
    client = AsyncTrainingClient(model, device="cpu", checkpoint_dir=tmp_path / "ck",
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="'../../escaped' is refused"):
        client.save_state("../../escaped")
    client.shutdown()
    assert list(tmp_path.iterdir()) == []


DDP_PARTIAL_SCRIPT = '''
import json, sys, torch
from transformers import AutoModelForCausalLM
from rl.engine.dist import end_program
from rl.engine.pipeline import ForwardBackwardPipeline

path, out = sys.argv[1], sys.argv[2]
def make(n, acc=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    return ForwardBackwardPipeline(model, gradient_accumulation_steps=n, accelerator=acc,
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
partial = make(4)
exact = make(1, partial.accelerator)
rank = partial.accelerator.process_index
ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(10 + rank))  # per-rank data
partial.forward_backward(ids).result()
exact.forward_backward(ids).result()
r = partial.optim_step().result()
exact.optim_step().result()
flat = lambda p: torch.cat([x.detach().flatten() for x in p.unwrapped_model.parameters()])
json.dump({"n": r.metrics["num_micro_batches"], "world": partial.accelerator.num_processes,
           "diff": float((flat(partial) - flat(exact)).abs().max()), "sum": float(flat(partial).double().sum())},
          open(f"{out}/rank{rank}.json", "w"))
partial.shutdown(); exact.shutdown()
end_program()  # as a launched program ends (docs/operations.md): no abort in the interpreter's teardown
'''


@pytest.mark.slow
def test_partial_accumulation_under_ddp_averages_across_processes(tiny_llama, tmp_path):
    """1 of 4 micro-batches per rank under 2-process DDP == gradient_accumulation_steps=1 under DDP:
    the k-th backward ran without DDP's all-reduce, so optim_step must average across ranks itself
    (without it each rank would step with its own gradient and the ranks would drift apart)."""
    import json

    from conftest import accelerate_cmd, run_cmd

    script = tmp_path / "ddp_partial.py"
    script.write_text(DDP_PARTIAL_SCRIPT)
    run_cmd(accelerate_cmd(str(script), tiny_llama, str(tmp_path)), timeout=300)
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [x["world"] for x in r] == [2, 2] and [x["n"] for x in r] == [1, 1]
    assert max(x["diff"] for x in r) < 1e-6
    assert r[0]["sum"] == r[1]["sum"]  # the ranks agree


def test_unread_failure_is_logged_when_the_pipeline_is_dropped(tiny_llama, caplog):
    """Without shutdown(): a failure nobody read is still logged when the pipeline goes away."""
    import gc
    import logging

    pipe = make(tiny_llama, 1)
    pipe.optim_step()  # fails (no micro-batch); its future is dropped unread
    pipe.forward_backward(batch(2)).result()  # later requests still run
    with caplog.at_level(logging.ERROR, logger="rl.engine"):
        del pipe
        gc.collect()
    assert [r.getMessage().splitlines()[0] for r in caplog.records] == [
        "engine request optim_step failed and its future was never read: RuntimeError: optim_step after 0 "
        "forward_backward calls since the last step: there is no gradient to apply; queue a forward_backward first"]


def test_partial_accumulation_is_refused_under_deepspeed(tiny_llama, monkeypatch):
    """DeepSpeed steps inside the N-th backward, so k < N cannot be applied: a clear error, state kept
    (checked with the DeepSpeed test stubbed: the rule runs before any DeepSpeed call)."""
    import rl.engine.pipeline as fb

    pipe = make(tiny_llama, 4)
    pipe.forward_backward(batch(2)).result()
    monkeypatch.setattr(fb, "is_deepspeed", lambda acc: True)
    with pytest.raises(RuntimeError, match="after 1 forward_backward calls, but gradient_accumulation_steps=4: under "
                                           "DeepSpeed the step happens inside the backward of the last micro-batch"):
        pipe.optim_step().result()
    monkeypatch.undo()
    assert pipe.micro_step == 1 and pipe.optim_step().result().metrics["num_micro_batches"] == 1


def test_deepspeed_cpu_shm_op_is_not_built(monkeypatch):
    """`rl.engine.dist._skip_cpu_shm_op`: DeepSpeed's comm backend then builds no shared-memory op (a fresh
    environment JIT-compiled it for ~1 minute at the first ZeRO-3 launch); RL_DEEPSPEED_SHM=1 leaves it on."""
    import deepspeed.ops
    from deepspeed.comm.torch import build_shm_op

    from rl.engine.dist import _skip_cpu_shm_op

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    monkeypatch.setenv("RL_DEEPSPEED_SHM", "1")
    _skip_cpu_shm_op()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is True
    monkeypatch.delenv("RL_DEEPSPEED_SHM")
    _skip_cpu_shm_op()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert build_shm_op() is None


def test_deepspeed_without_a_launcher_gets_a_one_process_world(monkeypatch):
    """`python launch/x.py deepspeed=...` (no `accelerate launch`): `rl.engine.dist._single_process_env` sets
    what torchrun would for one process; without it DeepSpeed's init_distributed tried MPI discovery and
    ended in "No module named 'mpi4py'". A launcher's environment is left as it is."""
    from rl.engine.dist import LAUNCHER_ENV, ONE_PROCESS_MARK, _single_process_env

    for key in (*LAUNCHER_ENV, "LOCAL_WORLD_SIZE", ONE_PROCESS_MARK):  # restored after the test
        monkeypatch.delenv(key, raising=False)
    _single_process_env()
    import os

    assert {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert int(os.environ["MASTER_PORT"]) > 0
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _single_process_env()
    assert "MASTER_ADDR" not in os.environ and os.environ["WORLD_SIZE"] == "2"


@pytest.mark.parametrize("raw", ["abc", "0", "-5"])
def test_rl_dist_timeout_that_is_not_positive_is_one_line(monkeypatch, raw):
    from rl.engine.dist import dist_timeout
    from rl.errors import ConfigError

    monkeypatch.setenv("RL_DIST_TIMEOUT", raw)
    with pytest.raises(ConfigError, match=r"^RL_DIST_TIMEOUT=.* must be a positive number of seconds; unset it"):
        dist_timeout()
    monkeypatch.setenv("RL_DIST_TIMEOUT", "7.5")
    assert dist_timeout().total_seconds() == 7.5


def test_deepspeed_that_accelerate_drops_is_one_line(tmp_path):
    """accelerate builds no DeepSpeed engine when told to use the CPU (ACCELERATE_USE_CPU=true; two machines so
    launched trained as plain DDP without a word): refused in one line naming the variable. A process of its own
    (accelerate's state is process-wide)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("from rl.engine.dist import build_accelerator\n"
            "from rl.errors import ConfigError\n"
            "try:\n    build_accelerator(deepspeed_config='ds_configs/zero3.json')\n"
            "except ConfigError as e:\n    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "ACCELERATE_USE_DEEPSPEED")}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"})
    assert "refused: DeepSpeed was asked for (key deepspeed) but accelerate set up" in r.stdout, r.stdout + r.stderr
    assert "unset ACCELERATE_USE_CPU" in r.stdout


def test_gradient_checkpointing_uses_transformers_current_name(tiny_llama):
    """`gradient_checkpointing: true` turns checkpointing on through `activation_checkpointing_enable`; the old
    `gradient_checkpointing_enable` is deprecated in transformers 5.2x and warned in every such run."""
    import warnings

    from rl.models.loading import load_causal_lm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_causal_lm(tiny_llama, dtype="float32", gradient_checkpointing=True)
    assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
    assert getattr(model, "is_activation_checkpointing", getattr(model, "is_gradient_checkpointing", False))


def test_a_child_forgets_its_parents_one_process_world(monkeypatch):
    """A DeepSpeed run in-process (tests do that) sets a 1-process world in os.environ; a launch script
    started from that process inherited it and tried to serve its parent's MASTER_PORT (EADDRINUSE, seen in
    CI). A launcher's own world, set after, is kept."""
    from rl.engine import dist

    for key in (*dist.LAUNCHER_ENV, "LOCAL_WORLD_SIZE", dist.ONE_PROCESS_MARK):
        monkeypatch.delenv(key, raising=False)
    dist._single_process_env()
    import os

    port = os.environ["MASTER_PORT"]
    monkeypatch.setenv(dist.ONE_PROCESS_MARK, f"1:{port}")  # as a child of process 1 sees it
    dist._drop_inherited_world()
    assert not any(k in os.environ for k in (*dist.LAUNCHER_ENV, dist.ONE_PROCESS_MARK))
    monkeypatch.setenv(dist.ONE_PROCESS_MARK, f"1:{port}")
    for key, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29611")):  # accelerate launch's, for its rank 1
        monkeypatch.setenv(key, value)
    dist._drop_inherited_world()
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["MASTER_PORT"] == "29611"
