"""The run core's lifecycle (rl/trainers/base.py), proven once over every registered trainer through its
launch script: a stop on SIGTERM checkpoints and exits 128 + 15; retention keeps save_total_limit
checkpoints; resume=auto falls back past a corrupt newest checkpoint; a rerun into a finished run is
refused; a diverging run stops at the first non-finite loss with one line and saves nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rl.config.fields import build
from rl.engine.state import complete_checkpoints, prune_checkpoints
from rl.errors import ConfigError, RunError
from rl.trainers.base import (
    CallbackTracker,
    NonFiniteError,
    check_finite,
    check_output_dir,
)
from rl.trainers.registry import TRAINERS as REGISTRY
from rl.trainers.sft import SFTConfig
from tests.conftest import ROOT, run_main


def _env() -> dict:
    # read at call time: the session fixture sets RL_TINY_CACHE after this module is imported
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RL_NO_PROGRESS": "1"}

# Every registered trainer (rl/trainers/registry.py), so that a new one is covered by being registered: its tiny
# recipe cut to {n} optimizer steps of a few examples by the entry's `short_run` overrides (PPO: iterations of one
# optimizer step each, num_iterations=1 and mini_batch_size=per_device_train_batch_size).
TRAINERS = list(REGISTRY)
COMMON = ["logging_steps=1", "report_to=[jsonl]"]
FINAL = {"reward": "reward_config.json"}  # the file a finished run writes (default model.safetensors)


def _cmd(trainer: str, out, n: int, *extra: str) -> list[str]:
    short = (a.format(n=n) for a in REGISTRY[trainer].short_run)
    return [sys.executable, f"launch/{trainer}.py", "--config", f"recipes/tiny/{trainer}.yaml", *short, *COMMON,
            f"output_dir={out}", *extra]


def _train_rows(out) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r or "objective/scores" in r]


def _signal_mid_run(cmd, out, rows: int, sig) -> tuple[subprocess.Popen, str]:
    """Start `cmd`, send `sig` once `rows` training rows are logged, and return the process and its output."""
    proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    deadline = time.time() + 300
    while len(_train_rows(out)) < rows and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc, proc.communicate(timeout=300)[0]


def _main(trainer: str, out, n: int, *extra: str, capfd, monkeypatch) -> tuple[int, str, str]:
    """The run `_cmd` describes, through the launch script's main() in this process (conftest.run_main)."""
    return run_main(trainer, _cmd(trainer, out, n, *extra)[2:], capfd, monkeypatch)


def _signal_in_process(trainer, out, rows: int, sig, capfd, monkeypatch) -> tuple[int, str]:
    """`_signal_mid_run` in this process: `sig` is raised in the run's own (main) thread once the row of
    step `rows` has passed the non-finite guard (fit() calls `check_finite` on every row), so the handler
    fit() installed receives it as it would an external one, between two statements of the loop. The
    exit status is the one main() raises (run_main returns it); a real process's status and an external
    sender are proven by the "sft" case and test_ctrl_c_checkpoints_and_exits_130."""
    import threading

    from rl.trainers import base

    assert threading.current_thread() is threading.main_thread()  # else fit() installs no handler
    real = base.check_finite

    def then_signal(row):
        real(row)
        if row["step"] == rows:
            # fit()'s handler, not the default action (which would kill this pytest process)
            assert isinstance(getattr(signal.getsignal(sig), "__self__", None), base._Stop), signal.getsignal(sig)
            signal.raise_signal(sig)

    monkeypatch.setattr(base, "check_finite", then_signal)
    code, stdout, stderr = _main(trainer, out, 500, "save_steps=1", "save_total_limit=2", capfd=capfd,
                                 monkeypatch=monkeypatch)
    monkeypatch.setattr(base, "check_finite", real)
    return code, stdout + stderr


# ------------------------------------------------------------------------------- unit level

def test_check_finite_names_step_and_metric():
    check_finite({"step": 3, "loss": 1.0, "grad_norm": 2.0, "other": float("nan")})  # only guarded keys
    with pytest.raises(NonFiniteError, match=r"step 3: loss is nan"):
        check_finite({"step": 3, "loss": float("nan")})
    with pytest.raises(NonFiniteError, match=r"step 4: grad_norm is inf"):
        check_finite({"step": 4, "loss": 1.0, "grad_norm": float("inf")})


def _fake_checkpoint(out, step: int, complete: bool = True):
    d = out / "checkpoints" / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if complete:
        (d / "COMPLETE").write_text("")
    return d


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    for s in (1, 2, 10, 3):
        _fake_checkpoint(tmp_path, s)
    partial = _fake_checkpoint(tmp_path, 11, complete=False)
    assert [d.name for d in complete_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-3", "checkpoint-2",
                                                                "checkpoint-1"]
    gone = prune_checkpoints(tmp_path, 2)
    assert sorted(d.name for d in gone) == ["checkpoint-1", "checkpoint-2"]
    assert [d.name for d in complete_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-3"]
    assert partial.exists()  # an interrupted write is not a checkpoint; retention leaves it alone
    assert prune_checkpoints(tmp_path, None) == []


def test_output_dir_guard(tmp_path):
    class Cfg:
        output_dir, resume, overwrite = str(tmp_path / "run"), None, False

    cfg = Cfg()
    check_output_dir(cfg)  # nothing there yet
    assert (tmp_path / "run" / ".rl-run.lock").exists()  # made for this process's run lock, not a previous run
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    _fake_checkpoint(tmp_path / "run", 2)
    with pytest.raises(RunError, match="holds a previous run .*resume=auto.*overwrite=true"):
        check_output_dir(cfg)
    cfg.resume = "auto"
    check_output_dir(cfg)  # continuing is fine
    cfg.resume, cfg.overwrite = None, True
    check_output_dir(cfg)  # replacing clears what a later resume=auto would pick up
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and complete_checkpoints(tmp_path / "run") == []
    (tmp_path / "file").write_text("x")
    cfg.output_dir = str(tmp_path / "file")
    with pytest.raises(RunError, match="is a file"):
        check_output_dir(cfg)


def test_callback_tracker_forwards_rows():
    seen = []
    t = CallbackTracker(lambda step, m: seen.append((step, m)))
    t.log(2, {"loss": 1.0})
    t.write("note")
    t.close()
    assert seen == [(2, {"loss": 1.0})]


# ------------------------------------------------------------------------- every registered trainer

@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
def test_sigterm_retention_corrupt_fallback_and_rerun(trainer, tmp_path, tiny_llama, capfd, monkeypatch):
    """(tiny_llama: the tiny model exists before the run starts.) For "sft" the signalled run is a process
    of its own that SIGTERM reaches from outside; for the others (the same fit(), each trainer's own
    checkpoint, restore and launch script) the signal is raised inside main() in this process, which saves
    a process start-up (Python, torch, transformers) per trainer. The resume and the refused rerun call
    the launch script's main() in this process."""
    out = tmp_path / "run"
    final = out / FINAL.get(trainer, "model.safetensors")
    # 1. SIGTERM mid-run: the step finishes, a checkpoint is written, exit 128 + 15, no final model
    if trainer == "sft":
        proc, log = _signal_mid_run(_cmd(trainer, out, 500, "save_steps=1", "save_total_limit=2"), out, 3,
                                    signal.SIGTERM)
        code = proc.returncode
    else:
        code, log = _signal_in_process(trainer, out, 3, signal.SIGTERM, capfd, monkeypatch)
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert "stopping on signal 15" in log and "Traceback" not in log, log[-3000:]
    assert not final.exists()
    ckpts = complete_checkpoints(out)
    stopped = int(ckpts[0].name.split("-")[1])
    assert len(ckpts) == 2 and stopped >= 3 and ckpts[1].name == f"checkpoint-{stopped - 1}", ckpts
    # 2. the newest checkpoint is unreadable: resume=auto warns and continues from the previous one
    (ckpts[0] / "model.safetensors").write_bytes(b"not a safetensors file")
    code, stdout, stderr = _main(trainer, out, stopped + 1, "resume=auto", capfd=capfd, monkeypatch=monkeypatch)
    text = stdout + stderr
    assert code == 0, text[-3000:]
    assert "cannot be loaded" in text and f"resumed from {ckpts[1]}" in text, text[-3000:]
    assert final.exists()
    # the console: one line per logged step of the resumed run (logging_steps=1), the step over the run's total
    shown = [tuple(map(int, m.groups())) for m in re.finditer(r"^step +(\d+)/(\d+) \| ", stdout, re.MULTILINE)]
    assert [s for s, _ in shown] == [stopped, stopped + 1] and {t for _, t in shown} == {stopped + 1}, stdout[-2000:]
    # 3. a new run into the finished one is refused before any model is built; nothing is touched
    before = final.stat().st_mtime_ns
    code, _, stderr = _main(trainer, out, 2, capfd=capfd, monkeypatch=monkeypatch)
    assert code == 2 and "error: " in stderr and "holds a previous run" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr and final.stat().st_mtime_ns == before


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
def test_diverging_run_stops_at_the_first_non_finite_loss(trainer, tmp_path, tiny_llama, capfd, monkeypatch):
    """The launch script's main() in this process (see `_main`): exit status 1, the last stderr line
    names the step and the metric, no traceback, no final model and no checkpoint of the bad step."""
    out = tmp_path / "run"
    # GRPO's math environment and PPO's 'a'-fraction give a random model all-zero rewards, hence zero
    # gradients and no update at all; the length-based default reward (words / 100) does not
    extra = {"grpo": ["reward_funcs=[default]", "reward_weights=[0,1]"], "online_dpo": ["reward_funcs=[default]"],
             "ppo": ["reward_fn=default", "custom_reward=null"]}.get(trainer, [])
    code, stdout, stderr = _main(trainer, out, 8, "learning_rate=1e30", "save_steps=1", *extra, capfd=capfd,
                                 monkeypatch=monkeypatch)
    err = stderr.strip().splitlines()
    assert code == 1, (stdout + stderr)[-3000:]
    assert err and err[-1].startswith("error: step ") and ("is nan" in err[-1] or "is inf" in err[-1]), err[-5:]
    assert "Traceback" not in stderr
    assert not (out / FINAL.get(trainer, "model.safetensors")).exists()
    bad = int(err[-1].split()[2].rstrip(":"))
    assert all(int(d.name.split("-")[1]) < bad for d in complete_checkpoints(out))  # no NaN checkpoint


def test_learning_rate_zero_or_nan_is_refused():
    for lr, said in ((0.0, "must be a positive number"), (float("nan"), "must be a finite number"),
                     (-1e-3, "must be a positive number")):
        with pytest.raises(ConfigError, match=f"learning_rate' {said}"):
            build(SFTConfig, {"model_name": "m", "learning_rate": lr})


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_exits_130(tmp_path, tiny_llama):
    """SIGINT is a stop like SIGTERM: the step finishes, a checkpoint is written, exit 128 + 2, no traceback."""
    out = tmp_path / "run"
    proc, log = _signal_mid_run(_cmd("sft", out, 500), out, 2, signal.SIGINT)
    assert proc.returncode == 128 + signal.SIGINT, log[-3000:]
    assert "stopping on signal 2" in log and "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert complete_checkpoints(out) and not (out / "model.safetensors").exists()


@pytest.mark.parametrize("fault", ["enospc", "zip_writer", "safetensors"])
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(fault, tmp_path, tiny_llama, monkeypatch):
    """A full disk while writing checkpoint-2 (ENOSPC from a write, torch.save's zip writer failing with
    its RuntimeError, or safetensors' own SafetensorError, the words it used on a real 64 KiB tmpfs): one
    RunError line naming the directory, the partial checkpoint is removed, checkpoint-1 stays complete and
    loadable."""
    import errno

    import safetensors.torch

    from rl.data.sft import tokenize_examples
    from rl.trainers.sft import SFTTrainer

    cfg = build(SFTConfig, {"model_name": tiny_llama, "output_dir": str(tmp_path / "run"), "max_steps": 4,
                            "save_steps": 1, "per_device_train_batch_size": 2, "report_to": ["none"], "learning_rate": 1e-3})
    trainer = SFTTrainer(cfg)
    data = tokenize_examples([{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(8)],
                             trainer.tokenizer, cfg)
    real_save, calls = safetensors.torch.save_file, []

    def full_disk(tensors, filename, *a, **k):
        calls.append(filename)
        if ".tmp-checkpoint-2" in str(filename):
            if fault == "zip_writer":
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 512 vs 448")
            if fault == "safetensors":
                from safetensors import SafetensorError

                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, filename, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(RunError, match=r"no space left on .*checkpoints while writing checkpoint-2; the previous"):
        trainer.train(data)
    root = tmp_path / "run" / "checkpoints"
    assert [d.name for d in complete_checkpoints(tmp_path / "run")] == ["checkpoint-1"]
    assert not (root / ".tmp-checkpoint-2").exists()
    assert set(safetensors.torch.load_file(str(root / "checkpoint-1" / "model.safetensors")))


def test_every_trainer_takes_config_then_model_and_tokenizer(tmp_path, tiny_llama):
    """One constructor shape, `XTrainer(config, model=..., tokenizer=...)`, for all six trainers: the
    given model and tokenizer are the ones the trainer holds (no second load from model_name)."""
    from rl.models.loading import load_causal_lm, load_tokenizer
    from rl.models.reward import RewardModel, RewardModelConfig
    from rl.trainers.dpo import DPOConfig, DPOTrainer
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig
    from rl.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    from rl.trainers.ppo import PPOTrainer
    from rl.trainers.ppo_config import PPOConfig
    from rl.trainers.reward import RewardModelTrainer
    from rl.trainers.sft import SFTTrainer

    def reward_fn(prompts, completions, **kw):
        return [0.0] * len(completions)

    base = {"model_name": tiny_llama, "report_to": ["none"], "max_length": 32}
    cases = {
        "sft": (SFTTrainer, build(SFTConfig, {**base, "output_dir": str(tmp_path / "sft")}), {}),
        "dpo": (DPOTrainer, build(DPOConfig, {**base, "output_dir": str(tmp_path / "dpo"), "max_prompt_length": 16}),
                {}),
        "grpo": (GRPOTrainer, build(GRPOConfig, {**base, "output_dir": str(tmp_path / "grpo"), "per_device_train_batch_size": 2,
                                                 "num_generations": 2, "max_completion_length": 4}),
                 {"reward_funcs": [reward_fn], "train_prompts": [{"prompt": "1+1="}]}),
        "online_dpo": (OnlineDPOTrainer, build(OnlineDPOConfig, {**base, "output_dir": str(tmp_path / "odpo"),
                                                                 "per_device_train_batch_size": 2, "max_completion_length": 4}),
                       {"reward_funcs": [reward_fn], "train_prompts": [{"prompt": "1+1="}]}),
        "ppo": (PPOTrainer, build(PPOConfig, {**base, "output_dir": str(tmp_path / "ppo"), "per_device_train_batch_size": 2,
                                              "max_new_tokens": 4}), {"reward_fn": reward_fn}),
    }
    for name, (cls, cfg, extra) in cases.items():
        model, tok = load_causal_lm(tiny_llama, dtype="float32"), load_tokenizer(tiny_llama)
        trainer = cls(cfg, model=model, tokenizer=tok, **extra)
        held = trainer.policy.base_model if name == "ppo" else trainer._model
        assert (held is model, trainer.tokenizer is tok, trainer.cfg is cfg) == (True, True, True), name
        if name == "ppo":  # train() without prompts takes an environment's; with none it is one clear error
            with pytest.raises(ConfigError, match="got no prompts"):
                trainer.train()
    rm_cfg = RewardModelConfig(model_name=tiny_llama, use_lora=False, dropout_prob=0.0)
    rm, tok = RewardModel(rm_cfg), load_tokenizer(tiny_llama)
    trainer = RewardModelTrainer(rm_cfg, model=rm, tokenizer=tok, output_dir=tmp_path / "rm")
    assert (trainer.model is rm, trainer.tokenizer is tok, trainer.cfg is rm_cfg) == (True, True, True)
    # the reference docs' keyword shape builds the model from the config
    assert isinstance(RewardModelTrainer(config=rm_cfg, tokenizer=tok).model, RewardModel)


def test_resume_with_another_lora_rank_keeps_the_size_mismatch_in_one_line(tmp_path, tiny_llama):
    """Issue 39 point 6: a checkpoint written with lora.rank=2 resumed with rank 4 is one RunError line that
    keeps torch's detail (the tensor, both shapes, how many more) and the fix; only torch's first line,
    "Error(s) in loading state_dict for PeftModelForCausalLM:", was kept."""
    from rl.data.sft import tokenize_examples
    from rl.trainers.sft import SFTTrainer

    def run(rank: int, **extra):
        cfg = build(SFTConfig, {"model_name": tiny_llama, "output_dir": str(tmp_path / "run"), "max_steps": 2,
                                "save_steps": 1, "per_device_train_batch_size": 2, "report_to": ["none"],
                                "lora": {"enabled": True, "rank": rank, "target_modules": "q_proj"}, **extra})
        trainer = SFTTrainer(cfg)
        trainer.train(tokenize_examples([{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(4)],
                                        trainer.tokenizer, cfg))

    run(2, max_steps=1)
    with pytest.raises(RunError) as e:
        run(4, resume="auto")
    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint-1"
    assert str(e.value) == (
        f"resume: checkpoint {ckpt} cannot be loaded (size mismatch for "
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight: [2, 64] in the checkpoint, "
        f"[4, 64] in this run's model, and 3 more tensors); the model differs from the one that wrote it (a changed "
        f"lora.rank, lora.target_modules or model_name?): resume with the settings it was written with, or start "
        f"a new output_dir")


def test_a_second_run_into_a_live_output_dir_is_refused_by_its_lock(tmp_path, capfd, monkeypatch):
    """Issue 39 point 9: while a run holds output_dir (its main process, from check_output_dir to exit), a
    second one is refused in one line naming the directory and the holder's pid, although the first has
    written nothing yet (only its metrics.jsonl, milliseconds in, refused it before); once the holder is
    gone, even killed, the directory is free again and the lock file names the new holder."""
    from rl.engine.state import RUN_LOCK

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rl.engine.state import hold_run_lock; "
                               f"hold_run_lock({str(out)!r}); print('held', flush=True); sys.stdin.read()"],
        cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = build(SFTConfig, {"model_name": "m", "output_dir": str(out), "report_to": ["none"]})
        with pytest.raises(RunError) as e:
            check_output_dir(cfg)
        assert str(e.value).startswith(f"output_dir={out} is in use by another run (pid {holder.pid} on ")
        assert str(e.value).endswith(f", holding {out / RUN_LOCK}); wait for it to end, or give another output_dir")
        code, stdout, stderr = run_main("sft", ["--config", "recipes/tiny/sft.yaml", f"output_dir={out}"], capfd,
                                        monkeypatch)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and errors == [f"error: {e.value}"] and "Traceback" not in stderr, stderr[-2000:]
    finally:
        holder.kill()  # SIGKILL: the kernel drops its lock
        holder.wait()
    check_output_dir(cfg)
    assert (out / RUN_LOCK).read_text().startswith(f"pid {os.getpid()} on ")
    assert not (out / "metrics.jsonl").exists()
