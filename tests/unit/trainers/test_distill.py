"""Distillation (GKD) trainer: the step loss is jsd_loss over the completion tokens of the two models'
logits, accumulation is exact, the recipe runs and saves, resume equals an uninterrupted run, --help."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.conftest import run_main


@pytest.fixture(scope="module")
def tiny_teacher(tiny_cache):
    from rl.models.tiny import write_tiny_model

    return str(write_tiny_model(tiny_cache / "qwen2", family="qwen2"))


def _cfg(student, teacher, out, **kw):
    from rl.config.fields import build
    from rl.trainers.distill import DistillConfig

    base = dict(model_name=student, teacher_model_name=teacher, output_dir=str(out), report_to=["none"],
                per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-3,
                lr_scheduler_type="constant", max_completion_length=8, max_length=32, beta=0.3, temperature=0.9,
                lmbda=0.0, data={"path": "data/tiny/sft_arith.jsonl"}, dtype="float32", seed=3)
    return build(DistillConfig, {**base, **kw})


def _trainer(cfg, tokenizer):
    from rl.trainers.distill import DistillTrainer

    return DistillTrainer(cfg, tokenizer=tokenizer, train_prompts=DistillTrainer.load_data(cfg))


def test_config_checks(tiny_llama):
    from rl.errors import ConfigError

    for bad in (dict(teacher_model_name=None), dict(lmbda=1.5), dict(beta=-0.1), dict(temperature=0.0),
                dict(env_type="math")):
        with pytest.raises(ConfigError):
            _cfg(tiny_llama, "tiny:qwen2", "/tmp/unused", **bad)
    # TRL GKD's max_new_tokens is the deprecated name of max_completion_length: alone it sets it, beside it
    # it is one error line rather than a silent choice
    from rl.config.fields import build
    from rl.trainers.distill import DistillConfig

    assert build(DistillConfig, dict(model_name=tiny_llama, teacher_model_name="tiny:qwen2",
                                     max_new_tokens=5)).max_completion_length == 5
    with pytest.raises(ConfigError, match="keys 'max_new_tokens' and 'max_completion_length' are the same setting"):
        _cfg(tiny_llama, "tiny:qwen2", "/tmp/unused", max_new_tokens=5)


def _trl_gkd_loss(student, teacher, b, beta: float) -> float:
    """TRL 1.16's GKDTrainer.compute_loss on batch `b` (its own forwards, no position ids: `b` must have no left
    padding), through a stand-in `self` holding what the method reads."""
    from types import SimpleNamespace

    from trl.experimental.gkd import gkd_trainer as gkd

    assert bool(b["attention_mask"][:, 0].all()), "equal-length prompts expected (no left padding)"
    fake = SimpleNamespace(teacher_model=teacher, beta=beta, generalized_jsd_loss=gkd.GKDTrainer.generalized_jsd_loss)
    with torch.no_grad():
        return gkd.GKDTrainer.compute_loss(fake, student, {k: b[k] for k in ("input_ids", "attention_mask", "labels")}).item()


def test_step_loss_is_jsd_of_the_two_models(tiny_llama, tiny_teacher, tiny_tokenizer, tmp_path, monkeypatch):
    """Off-policy step on fixed data rows: the logged loss equals rl.algos.distill.jsd_loss of the student's and
    the teacher's logits (one forward each over the whole step's batch) over completion tokens; accumulation
    2 x 4 moves the parameters as 1 x 8 does."""
    from rl.algos.distill import jsd_loss

    monkeypatch.chdir(__import__("conftest").ROOT)
    trainer = _trainer(_cfg(tiny_llama, tiny_teacher, tmp_path / "a"), tiny_tokenizer)
    trainer._plan = trainer.plan()
    b, on_policy = trainer.step_batch(0)
    assert not on_policy
    # labels -100 on the prompt and padding: the completion tokens (with EOS) are all that count
    from rl.rollout.prompts import step_prompts
    from rl.trainers.distill import completion_ids

    rows = step_prompts(None, trainer.train_prompts, 3, 0, 8)
    assert int((b["labels"] != -100).sum()) == sum(len(completion_ids(tiny_tokenizer, r["completion"], 8)) for r in rows)
    with torch.no_grad():
        kw = dict(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
        s = trainer._model(**kw).logits
        t = trainer.reference.model(**kw).logits
    mask = b["labels"][:, 1:] != -100
    expected = jsd_loss(s[:, :-1], t[:, :-1], mask, beta=0.3).item()
    student0 = copy.deepcopy(trainer._model)
    hist = trainer.train()
    trl_loss = _trl_gkd_loss(student0, trainer.reference.model, b, beta=0.3)
    print(f"step loss {hist[0]['loss']:.9f} TRL GKDTrainer.compute_loss {trl_loss:.9f} "
          f"diff {abs(hist[0]['loss'] - trl_loss):.3g}")
    assert abs(hist[0]["loss"] - trl_loss) < 1e-6
    print(f"step loss {hist[0]['loss']:.9f} by hand {expected:.9f} diff {abs(hist[0]['loss'] - expected):.3g}")
    assert abs(hist[0]["loss"] - expected) < 1e-6, (hist[0]["loss"], expected)
    assert hist[0]["on_policy"] == 0.0 and expected > 0
    one = _trainer(_cfg(tiny_llama, tiny_teacher, tmp_path / "b", per_device_train_batch_size=8, gradient_accumulation_steps=1),
                   tiny_tokenizer)
    h1 = one.train()
    assert abs(h1[0]["loss"] - hist[0]["loss"]) < 1e-6
    pa = dict(one.pipeline.unwrapped_model.named_parameters())
    diff = max((pa[n] - p).abs().max().item() for n, p in trainer.pipeline.unwrapped_model.named_parameters())
    print(f"accumulation 2x4 vs 1x8: loss diff {abs(h1[0]['loss'] - hist[0]['loss']):.3g}, parameters {diff:.3g}")
    assert diff < 1e-6, diff


def test_on_policy_step_loss_is_jsd_of_the_samples(tiny_llama, tiny_teacher, tiny_tokenizer, tmp_path, monkeypatch):
    """lmbda=1: the step trains on the student's samples; its loss is jsd_loss over the sampled completion
    tokens, from the initial student's and the teacher's logits."""
    from rl.algos.distill import jsd_loss

    monkeypatch.chdir(__import__("conftest").ROOT)
    trainer = _trainer(_cfg(tiny_llama, tiny_teacher, tmp_path / "a", lmbda=1.0), tiny_tokenizer)
    student0 = copy.deepcopy(trainer._model)
    seen = []
    step_batch = trainer.step_batch
    monkeypatch.setattr(trainer, "step_batch", lambda step: seen.append(step_batch(step)) or seen[-1])
    hist = trainer.train()
    b, on_policy = seen[0]
    assert on_policy and hist[0]["on_policy"] == 1.0
    with torch.no_grad():
        kw = dict(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
        s, t = student0(**kw).logits, trainer.reference.model(**kw).logits
    expected = jsd_loss(s[:, :-1], t[:, :-1], b["labels"][:, 1:] != -100, beta=0.3).item()
    print(f"on-policy step loss {hist[0]['loss']:.9f} by hand {expected:.9f} diff {abs(hist[0]['loss'] - expected):.3g}")
    assert abs(hist[0]["loss"] - expected) < 1e-6


def test_prompt_tokens_are_not_counted(tiny_llama, tiny_tokenizer, tmp_path, monkeypatch):
    from rl.trainers.distill import completion_ids, distill_batch

    monkeypatch.chdir(__import__("conftest").ROOT)
    b = distill_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    assert b["labels"].tolist() == [[-100, -100, -100, 5, 6, -100], [-100, -100, -100, 7, 8, 9]]
    assert b["position_ids"][1].tolist()[2:] == [0, 1, 2, 3]
    ids = completion_ids(tiny_tokenizer, "12", 8)
    assert ids[-1] == tiny_tokenizer.eos_token_id and len(ids) == 3 and len(completion_ids(tiny_tokenizer, "12", 2)) == 2


def test_recipe_runs_and_saves(tmp_path, tiny_llama, capfd, monkeypatch):
    out = tmp_path / "run"
    code, stdout, stderr = run_main("distill", ["--config", "recipes/tiny/distill.yaml", f"output_dir={out}",
                                                "max_steps=2"], capfd, monkeypatch)
    assert code == 0, stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss", "grad_norm", "learning_rate", "on_policy", "step_time"):
        assert all(key in r for r in rows), key
    assert (out / "model.safetensors").exists() and (out / "README.md").exists() and "distill done" in stdout


def test_resume_equals_uninterrupted(tmp_path, tiny_llama, capfd, monkeypatch):
    """seed 3 draws off, on | off, on: both kinds of step before and after the cut."""
    def run(out, *extra):
        code, _, stderr = run_main("distill", ["--config", "recipes/tiny/distill.yaml", f"output_dir={out}",
                                               "seed=3", "per_device_train_batch_size=4", *extra], capfd, monkeypatch)
        assert code == 0, stderr[-2000:]
        rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # the resumed run continues at 3
        return {r["step"]: r for r in rows}

    full = run(tmp_path / "full", "max_steps=4")
    run(tmp_path / "cut", "max_steps=2", "save_steps=2")
    resumed = run(tmp_path / "cut", "max_steps=4", "resume=auto")
    assert [full[s]["on_policy"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    for s in (1, 2, 3, 4):
        for key in ("loss", "grad_norm", "learning_rate", "on_policy", "completions/mean_length"):
            assert abs(full[s][key] - resumed[s][key]) < 1e-6, (s, key, full[s][key], resumed[s][key])
            print(f"resume {s} {key} diff {abs(full[s][key] - resumed[s][key]):.3g}")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    wdiff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"resume final weights diff {wdiff:.3g}")
    assert wdiff < 1e-6


def test_help(capfd, monkeypatch):
    code, stdout, _ = run_main("distill", ["--help"], capfd, monkeypatch)
    assert code == 0
    for key in ("lmbda", "beta", "temperature", "teacher_model_name", "max_new_tokens", "seq_kd"):
        assert key in stdout, key


def test_missing_completion_is_one_line(tmp_path, capfd, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n')
    code, _, stderr = run_main("distill", ["--config", "recipes/tiny/distill.yaml", f"output_dir={tmp_path / 'o'}",
                                           f"data.path={data}"], capfd, monkeypatch)
    assert code != 0 and "row 2" in stderr and "completion" in stderr, stderr[-1000:]


def test_seq_kd_trains_on_the_teachers_samples(tiny_llama, tiny_teacher, tiny_tokenizer, tmp_path, monkeypatch):
    from rl.engine.generation import generate

    monkeypatch.chdir(__import__("conftest").ROOT)
    trainer = _trainer(_cfg(tiny_llama, tiny_teacher, tmp_path / "a", seq_kd=True), tiny_tokenizer)
    used = []
    import rl.trainers.distill as mod

    monkeypatch.setattr(mod, "generate", lambda model, *a, **k: used.append(model) or generate(model, *a, **k))
    hist = trainer.train()
    assert used == [trainer.reference.model] and hist[0]["on_policy"] == 0.0


@pytest.mark.slow
def test_it_learns_the_student_moves_toward_the_teacher(tmp_path, tiny_llama, tiny_teacher, tiny_tokenizer, capfd,
                                                        monkeypatch):
    """It learns: the recipe (8 steps, half of them on the student's own samples) lowers the generalised
    JSD between student and teacher (prompt + the data's completion, completion tokens only, on the last 16
    rows of the recipe's data: distillation fits the teacher's distribution, there is no answer to hold
    out) to at most MAX_JSD_RATIO of the untrained student's. Measured over seeds 0-3 (RL_TEST_SEED;
    1 and 2 threads give the same numbers, run_main computes with one): 0.549 to 0.691, so the bound 0.9
    sits 0.21 above the worst run."""
    from rl.algos.distill import jsd_loss
    from rl.data.records import read_records
    from rl.models.loading import load_causal_lm
    from tests.conftest import LEARN_SEED, learned

    out = tmp_path / "run"
    code, _, stderr = run_main("distill", ["--config", "recipes/tiny/distill.yaml", f"output_dir={out}",
                                           f"teacher_model_name={tiny_teacher}", f"model_name={tiny_llama}",
                                           f"seed={LEARN_SEED}"], capfd, monkeypatch)
    assert code == 0, stderr[-2000:]
    rows = read_records("data/tiny/sft_arith.jsonl")[-16:]

    def held_out_jsd(model_dir) -> float:
        student = load_causal_lm(str(model_dir), dtype="float32").eval()
        teacher = load_causal_lm(tiny_teacher, dtype="float32").eval()
        total = 0.0
        with torch.no_grad():
            for r in rows:
                p = tiny_tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
                c = tiny_tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
                ids = torch.tensor([[tiny_tokenizer.bos_token_id] + p + c])
                mask = torch.zeros(ids.shape, dtype=torch.bool)
                mask[0, len(p):-1] = True  # positions that predict a completion token
                total += float(jsd_loss(student(ids).logits, teacher(ids).logits, mask, beta=0.5))
        return total / len(rows)

    ratio = held_out_jsd(out) / held_out_jsd(tiny_llama)
    assert learned("distill_jsd_ratio", ratio) <= MAX_JSD_RATIO


MAX_JSD_RATIO = 0.9


def test_a_teacher_whose_tokenizer_maps_ids_to_other_tokens_is_refused(tmp_path, tiny_llama, capfd, monkeypatch):
    """The same number of ids (and of output rows), two digits' ids swapped: the loss would compare the
    teacher's '1' with the student's '0'. One line naming the key and the first differing id, exit 2, before
    any model is loaded; the shipped recipe's tiny:qwen2 teacher (whose class adds a token of its own) passes."""
    from rl.models.loading import load_tokenizer, vocabulary_mismatch
    from tests.conftest import swapped_digits_copy

    teacher = tmp_path / "teacher"
    vocab = swapped_digits_copy(tiny_llama, teacher)
    student_tok, teacher_tok = load_tokenizer(tiny_llama), load_tokenizer(str(teacher))
    assert len(student_tok) == len(teacher_tok)
    assert vocabulary_mismatch(student_tok, teacher_tok) == (
        f"maps id {vocab['1']} to '1' where the student's tokenizer has '0' (2 of 259 shared ids differ)")
    assert vocabulary_mismatch(student_tok, load_tokenizer("tiny:qwen2")) is None
    code, _, stderr = run_main("distill", ["--config", "recipes/tiny/distill.yaml", f"output_dir={tmp_path / 'out'}",
                                           f"model_name={tiny_llama}", f"teacher_model_name={teacher}"],
                               capfd, monkeypatch)
    lines = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert lines[0].startswith(f"error: key 'teacher_model_name': {teacher}'s tokenizer maps id "), lines
