"""Every failure is one clear line, and nothing is lost (issue 13 points 1, 3, 6; issue 15 point 3).

Each bad input runs a launch script with its tiny recipe and asserts: the exit code (2 for a mistake in
the input), exactly one `error:` line that names the culprit (key, file or value), no traceback, and
that what an existing output_dir held is unchanged. Most kinds fail before any model is built, so they
run in this process (`main(argv)`, the import paid once); one subprocess per kind proves the same from
the command line, traceback-free."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl.errors import ConfigError
from rl.trainers.registry import TRAINERS as REGISTRY
from tests.conftest import ROOT, launch_module, run_main

# every registered trainer (rl/trainers/registry.py: a new one is covered by being registered), and the pipeline
TRAINERS = tuple(REGISTRY)  # the scripts with deepspeed/resume keys
SCRIPTS = (*TRAINERS, "pipeline")
SENTINEL = {"keep.txt": "written by an earlier run\n"}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RL_NO_PROGRESS": "1",
            "HF_HUB_OFFLINE": "1"}




def _argv(script: str, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "recipes" / "tiny" / f"{script}.yaml"), *extra]


def _prepared_out(tmp_path: Path) -> Path:
    """An output_dir holding something an earlier step wrote (it must survive every failure)."""
    out = tmp_path / "out"
    out.mkdir()
    for name, text in SENTINEL.items():
        (out / name).write_text(text)
    return out


def _assert_kept(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == sorted(SENTINEL)
    for name, text in SENTINEL.items():
        assert (out / name).read_text() == text


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def fails_in_process(capsys, script: str, *extra: str, names: tuple[str, ...], code: int = 2,
                     out: Path | None = None) -> str:
    """Run launch/<script>.py main() and assert one `error:` line naming every string in `names`."""
    argv = _argv(script, *extra, *([f"output_dir={out}"] if out is not None else []))
    with pytest.raises(SystemExit) as e:
        launch_module(script).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    lines = _error_lines(err)
    assert len(lines) == 1, err
    for n in names:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in err
    if out is not None:
        _assert_kept(out)
    return lines[0]


def fails_in_subprocess(script: str, *extra: str, names: tuple[str, ...], code: int = 2) -> str:
    r = subprocess.run([sys.executable, f"launch/{script}.py", *_argv(script, *extra)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=_env())
    text = r.stdout + r.stderr
    assert r.returncode == code, text
    assert "Traceback" not in text, text
    lines = _error_lines(r.stderr)
    assert len(lines) == 1, text
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------ model paths

@pytest.mark.parametrize("script", SCRIPTS)
def test_model_path_that_does_not_exist(capsys, tmp_path, script):
    out = _prepared_out(tmp_path)
    missing = tmp_path / "no-such-model"
    fails_in_process(capsys, script, f"model_name={missing}", out=out, names=("model_name", str(missing),
                                                                              "does not exist"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_directory_without_config_json(capsys, tmp_path, script):
    out = _prepared_out(tmp_path)
    d = tmp_path / "not-a-model"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    fails_in_process(capsys, script, f"model_name={d}", out=out, names=("model_name", "config.json"))


@pytest.fixture
def corrupt_model(tmp_path, tiny_llama):
    """A copy of the tiny model whose safetensors file is cut in half (a broken download)."""
    d = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, d)
    f = next(d.glob("*.safetensors"))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return d, f


@pytest.mark.parametrize("script", SCRIPTS)
def test_corrupt_safetensors(capsys, tmp_path, corrupt_model, script):
    out = _prepared_out(tmp_path)
    d, f = corrupt_model
    fails_in_process(capsys, script, f"model_name={d}", out=out, names=("model_name", str(f), "safetensors"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_tiny_family_leaves_nothing_in_the_cache(capsys, tmp_path, script):
    out = _prepared_out(tmp_path)
    cache = Path(os.environ["RL_TINY_CACHE"])
    before = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    fails_in_process(capsys, script, "model_name=tiny:unknownfamily", out=out,
                     names=("model_name", "tiny:unknownfamily", "llama"))
    assert (sorted(p.name for p in cache.iterdir()) if cache.exists() else []) == before


def test_pipeline_unknown_tiny_family(capsys, tmp_path):
    out = _prepared_out(tmp_path)
    fails_in_process(capsys, "pipeline", "tiny_family=unknownfamily", out=out,
                     names=("tiny_family", "unknownfamily"))


def test_write_tiny_model_refuses_an_unknown_family_before_writing(tmp_path):
    from rl.models.tiny import write_tiny_model

    with pytest.raises(ValueError, match="unknownfamily"):
        write_tiny_model(tmp_path / "m", family="unknownfamily")
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_directory_in_the_tiny_cache_is_removed(tmp_path):
    """A build killed half-way leaves `.<name>.tmp-<pid>`; the next build removes it and succeeds."""
    from rl.models.tiny import write_tiny_model

    stale = tmp_path / ".m.tmp-999999"
    stale.mkdir()
    (stale / "config.json").write_text("{half written")
    out = write_tiny_model(tmp_path / "m", family="llama", hidden=16, layers=1, heads=2)
    assert (out / "config.json").exists() and (out / "tiny_spec.json").exists()
    assert not stale.exists()
    assert not list(tmp_path.glob(".m.tmp-*"))


def test_hub_id_that_cannot_be_loaded_offline(capsys, tmp_path, monkeypatch):
    """A hub id that is not in the local cache fails at preflight, in one line and before any library retries:
    offline (HF_HUB_OFFLINE, the suite's setting), or with the hub unreachable, where huggingface_hub retried
    for ~60 s, printing a line per retry, before transformers' error. Unreachable, the run then goes offline
    (a cached model loads without those retries)."""
    from rl.scripts import common

    out = _prepared_out(tmp_path)
    name = "no-such-org/no-such-model"
    fails_in_process(capsys, "sft", f"model_name={name}", out=out,
                     names=("key 'model_name'", name, "not in the local Hugging Face cache", "(HF_HUB_OFFLINE is set)"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(common, "hub_unreachable", lambda: "huggingface.co cannot be reached: [Errno -2] Name or "
                                                           "service not known")
    fails_in_process(capsys, "grpo", f"model_name={name}", out=out,
                     names=(name, "(huggingface.co cannot be reached: [Errno -2]", f"hf download {name}"))
    assert os.environ["HF_HUB_OFFLINE"] == "1"


# ------------------------------------------------------------------------- deepspeed, resume, output

@pytest.mark.parametrize("script", TRAINERS)
def test_deepspeed_file_that_does_not_exist(capsys, tmp_path, script):
    out = _prepared_out(tmp_path)
    fails_in_process(capsys, script, f"deepspeed={tmp_path / 'zero9.json'}", out=out,
                     names=("deepspeed", "zero9.json", "does not exist"))


def _broken_bitsandbytes(tmp_path: Path, monkeypatch) -> None:
    """A bitsandbytes whose native library does not load (as on an unsupported platform), first on sys.path."""
    site = tmp_path / "site"
    (site / "bitsandbytes").mkdir(parents=True)
    (site / "bitsandbytes" / "__init__.py").write_text(
        'raise OSError("libbitsandbytes_cpu.so: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "bitsandbytes" or m.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("script,extra,names", [
    ("sft", "optim=adamw_8bit", ("key 'optim'", "adamw_8bit", "bitsandbytes", "optim=adamw_torch")),
    ("reward", "load_in_4bit=true", ("key 'load_in_4bit'", "bitsandbytes", "load_in_4bit=false"))])
def test_bitsandbytes_that_cannot_load_is_refused_at_preflight(capsys, tmp_path, monkeypatch, script, extra, names):
    """Before: the run started, built its model and failed at the optimizer with a traceback."""
    _broken_bitsandbytes(tmp_path, monkeypatch)
    out = _prepared_out(tmp_path)
    args = (extra, "lora.enabled=true") if script == "reward" else (extra,)
    line = fails_in_process(capsys, script, *args, out=out, names=(*names, "OSError", "libbitsandbytes_cpu.so"))
    assert "pip install bitsandbytes" in line


@pytest.mark.parametrize("script", TRAINERS)
def test_resume_path_that_does_not_exist(capsys, tmp_path, script):
    out = _prepared_out(tmp_path)
    fails_in_process(capsys, script, f"resume={tmp_path / 'checkpoint-7'}", out=out,
                     names=("resume", "checkpoint-7", "does not exist"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_output_dir_inside_a_file(capsys, tmp_path, script):
    f = tmp_path / "a-file"
    f.write_text("precious")
    fails_in_process(capsys, script, f"output_dir={f / 'run'}", names=("output_dir", str(f), "is a file"))
    assert f.read_text() == "precious"


@pytest.mark.parametrize("script", ("sft", "pipeline"))
def test_output_dir_that_is_a_file(capsys, tmp_path, script):
    f = tmp_path / "a-file"
    f.write_text("precious")
    line = fails_in_process(capsys, script, f"output_dir={f}", names=(str(f),))
    assert "file" in line
    assert f.read_text() == "precious"


def test_output_dir_not_writable(capsys, tmp_path, monkeypatch):
    """Root may write anywhere, so the permission is simulated: os.access says the parent is read-only."""
    import rl.scripts.common as lu

    ro = tmp_path / "readonly"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(lu.os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    for script in SCRIPTS:
        fails_in_process(capsys, script, f"output_dir={ro / 'run'}", names=("output_dir", str(ro), "not writable"))
    assert list(ro.iterdir()) == []


# --------------------------------------------------------------------------------- config values

@pytest.mark.parametrize("script,key,value", [
    ("grpo", "env_config", "{problems_path: x"),
    ("grpo", "reward_weights", "[1, 2"),
    ("ppo", "env_config", "{a: 1"),
    ("ppo", "reward_weights", "{correct: 1"),
    ("pipeline", "env_config", "{problems_path: x"),
])
def test_malformed_inline_yaml(capsys, tmp_path, script, key, value):
    out = _prepared_out(tmp_path)
    fails_in_process(capsys, script, f"{key}={value}", out=out, names=(key, value, "YAML"))


@pytest.mark.parametrize("script,value,culprit", [
    ("grpo", "[1, abc]", "'abc'"),
    ("ppo", "{correct: 1, length: heavy}", "'heavy'"),
])
def test_reward_weights_that_are_not_numbers(capsys, tmp_path, script, value, culprit):
    out = _prepared_out(tmp_path)
    fails_in_process(capsys, script, f"reward_weights={value}", out=out,
                     names=("reward_weights", culprit, "float"))


def test_config_errors_from_the_command_line():
    fails_in_subprocess("ppo", "reward_weights={a: 1, b: x}", names=("reward_weights", "'x'"))


# ------------------------------------------------------------------------------------------ data

def _bad_utf8(tmp_path: Path, row: dict) -> Path:
    """Line 1 valid, line 2 with a Latin-1 byte (0xe9, 'é') inside a string."""
    p = tmp_path / "bad.jsonl"
    good = json.dumps(row).encode()
    p.write_bytes(good + b"\n" + good[:-2] + b'\xe9"}\n')
    return p


# one row every trainer's default columns read (text, prompt, completion, chosen/rejected, label)
# (a string last: _bad_utf8 puts the bad byte inside it)
ROW = {"label": True, "prompt": "1+1=", "completion": "2", "chosen": "2", "rejected": "3", "text": "1+1=2"}


@pytest.mark.parametrize("script", TRAINERS)
def test_invalid_utf8_names_the_line(capsys, tmp_path, script):
    out = _prepared_out(tmp_path)
    p = _bad_utf8(tmp_path, ROW)
    extra = ["env_type=null", "reward_funcs=[correctness]"] if script == "grpo" else []
    if script == "ppo":
        extra = ["env_type=null"]
    fails_in_process(capsys, script, f"data.path={p}", *extra, out=out, names=(f"{p}:2", "UTF-8"))


# the missing column of a question/answer file, per trainer, and the key the line proposes
MISSING = {"sft": ("no 'text' column, no 'prompt'/'completion' pair", "set data.prompt_column=question "
                   "data.completion_column=answer"),
           "reward": ("no column 'chosen'", "set data.chosen_column=<the column that holds it>"),
           "dpo": ("no column 'prompt'", "set data.prompt_column=question"),
           "kto": ("no column 'prompt'", "set data.prompt_column=question"),
           "ppo": ("no column 'text'", "set data.text_column=question"),
           "grpo": ("no column 'prompt'", "set data.prompt_column=question"),
           "online_dpo": ("no column 'prompt'", "set data.prompt_column=question"),
           "distill": ("no column 'prompt'", "set data.prompt_column=question")}


@pytest.mark.parametrize("script", TRAINERS)
def test_a_missing_column_names_the_key_that_maps_it_before_any_model(capsys, tmp_path, script):
    """A `question`/`answer` file: file:line, the missing column, the columns present and the data.*_column key
    to set, exit 2, before any model is built (it was "column 'text' must be a non-empty string" for GRPO)."""
    out = _prepared_out(tmp_path)
    p = tmp_path / "qa.jsonl"
    p.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    extra = {"grpo": ["env_type=null", "reward_funcs=[correctness]"], "ppo": ["env_type=null"]}.get(script, [])
    missing, fix = MISSING[script]
    fails_in_process(capsys, script, f"data.path={p}", *extra, out=out,
                     names=(f"{p}:1: {missing}", "(columns present: answer, question)", fix))


@pytest.mark.parametrize("script,extra", [("grpo", ["env_type=null", "reward_funcs=[correctness]"]),
                                          ("ppo", ["env_type=null", "reward_fn=correctness"])])
def test_a_reward_functions_column_is_checked_before_any_model(capsys, tmp_path, script, extra):
    """correctness reads each row's `answer`: a file of prompts alone is one line naming the function, the column and
    the columns present, exit 2, before any model (it was a ValueError at the first reward, after the model loaded)."""
    out = _prepared_out(tmp_path)
    p = tmp_path / "prompts.jsonl"
    col = "prompt" if script == "grpo" else "text"
    p.write_text("".join(json.dumps({col: f"{i}+1="}) + "\n" for i in range(8)))
    fails_in_process(capsys, script, f"data.path={p}", *extra, out=out,
                     names=(f"{p}:1: reward function 'correctness' reads column 'answer'", f"present: {col})"))


def test_keys_without_effect_are_refused(capsys, tmp_path):
    """The tiny GRPO recipe's math environment supplies the prompts: a data.path beside it trained to the end
    without being read. A data key the trainer does not read (PPO's prompts are data.text_column), and the
    environment's own reward reading a column its prompts lack, are one line each too."""
    out = _prepared_out(tmp_path)
    p = tmp_path / "qa.jsonl"
    p.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    fails_in_process(capsys, "grpo", "reward_funcs=[correctness]", f"data.path={p}", out=out,
                     names=(f"data.path={p} would not be read: env_type=math supplies the prompts", "env_type=null"))
    fails_in_process(capsys, "ppo", "data.prompt_column=question", out=out,
                     names=("key 'data.prompt_column' has no effect in the ppo trainer", "data.text_column=question"))
    fails_in_process(capsys, "grpo", "data.eval_path=x.jsonl", out=out,
                     names=("key 'data.eval_path' has no effect in the grpo trainer", "eval_env_config"))
    from rl.config.fields import build
    from rl.models.loading import load_tokenizer
    from rl.trainers.grpo_config import GRPOConfig
    from rl.trainers.rewards import build_reward_fns

    cfg = build(GRPOConfig, {"model_name": "tiny:llama", "env_type": "code", "reward_funcs": ["correctness"]})
    with pytest.raises(ConfigError, match=r"^env_type=code: reward function 'correctness' reads column 'answer', "
                                          r"which the environment's prompts' metadata lacks \(columns present: tests\)"):
        build_reward_fns(cfg, load_tokenizer("tiny:llama"))  # before the policy: the trainers build rewards first


def test_chat_column_holding_a_string(capsys, tmp_path):
    out = _prepared_out(tmp_path)
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                          "content": "yo"}]}) + "\n"
                 + json.dumps({"messages": "user: hi assistant: yo"}) + "\n")
    fails_in_process(capsys, "sft", f"data.path={p}", out=out, names=(f"{p}:2", "'messages'", "list"))


def test_bad_data_from_the_command_line(tmp_path):
    p = _bad_utf8(tmp_path, ROW)
    fails_in_subprocess("sft", f"data.path={p}", f"output_dir={tmp_path / 'o'}", names=(f"{p}:2", "UTF-8"))


# ----------------------------------------------------------------------------- reward model source

def test_causal_lm_as_reward_model_is_refused(capsys, tmp_path, tiny_llama):
    out = _prepared_out(tmp_path)
    for name in ("tiny:llama", str(tiny_llama)):
        fails_in_process(capsys, "ppo", f"reward_model_path={name}", "reward_fn=null", out=out,
                         names=("reward_model_path", "not a reward model"))


def test_reward_model_problem():
    """A reward_config.json or a *ForSequenceClassification config passes; a causal LM does not."""
    from rl.models.reward_format import reward_model_problem
    from rl.models.sources import resolve_model_path

    assert reward_model_problem(resolve_model_path("tiny:llama-classifier")) is None
    problem = reward_model_problem(resolve_model_path("tiny:llama"))
    assert "LlamaForCausalLM" in problem and "launch/reward.py" in problem


def test_load_reward_model_refuses_a_causal_lm(tiny_llama):
    from rl.models.reward import load_reward_model

    with pytest.raises(ValueError, match="not a reward model"):
        load_reward_model(tiny_llama)


# --------------------------------------------------------------------------- corner cases of sizes

def test_grpo_max_steps_with_fewer_prompts_than_one_step(capsys, tmp_path, monkeypatch):
    """Was ZeroDivisionError: plan() skipped the size check when max_steps was set. Now said before any model
    loads (in this process: the launch's main() stops at its data step)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(2)))
    out = _prepared_out(tmp_path)
    line = fails_in_process(capsys, "grpo", "env_type=null", f"data.path={p}", "reward_funcs=[correctness]",
                            "per_device_train_batch_size=32", "num_generations=8", "max_steps=3", out=out,
                            names=("2 training prompts", "4"))
    assert "batch_size" in line


@pytest.mark.parametrize("script,extra", [
    ("grpo", ["env_type=null", "reward_funcs=[correctness]", "per_device_train_batch_size=32", "num_generations=8"]),
    ("online_dpo", ["per_device_train_batch_size=4"]),
    ("distill", ["per_device_train_batch_size=2", "gradient_accumulation_steps=2"]),
])
def test_dry_run_refuses_fewer_prompts_than_one_step_as_the_launch_does(script, extra, tmp_path, capsys,
                                                                         monkeypatch):
    """A trainer whose every step draws distinct prompts: with 3 rows and a step of 4, the launch refuses
    in one line; --dry-run printed a plan of `steps_per_epoch: 0` (GRPO) or 1 (online DPO, distillation)
    without a word. Now it prints the launch's own line, exit 2 (WORLD_SIZE=1: the plan is for one process)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1), "answer": str(i + 1)}) + "\n"
                         for i in range(3)))
    args = [f"data.path={p}", "data.prompt_column=prompt", *extra]
    expected = fails_in_process(capsys, script, *args, f"output_dir={tmp_path / 'run'}",
                                names=("3 training prompts are fewer than one step's 4",))
    assert fails_in_process(capsys, script, *args, "--dry-run", names=()) == expected


def _long_rows(tmp_path, n: int = 8):
    """Rows whose prompt and completion are ~1,300 tokens each: past GPT-2's 1,024 positions."""
    p = tmp_path / "long.jsonl"
    p.write_text("".join(json.dumps({"prompt": "1+" * 650 + "1=", "completion": "2" * 1300, "answer": "2",
                                     "chosen": "2" * 1300, "rejected": "3" * 1300, "label": True}) + "\n"
                         for _ in range(n)))
    return p


CONTEXT_LINE = ("key 'max_length': {n} tokens exceed tiny:gpt2's context of 1024 positions (its config's "
                "n_positions); set max_length=1024 or less")


@pytest.mark.parametrize("script,extra", [
    ("sft", ["max_length=2048"]),
    ("dpo", ["max_length=2048", "max_prompt_length=1024"]),
    ("reward", ["max_length=2048"]),
    ("grpo", ["max_length=2048", "max_completion_length=200", "env_type=null", "reward_funcs=[default]",
              "per_device_train_batch_size=8", "num_generations=4"]),
])
def test_max_length_above_the_models_context_is_refused(script, extra, tmp_path, capsys, monkeypatch):
    """GPT-2's learned position table has 1,024 rows: a longer SFT row crashed the forward (IndexError), GRPO's
    prompts (max_length - max_completion_length of them) plus the completion crashed sampling. Refused in one
    line naming the key and the limit, by the launch and by its --dry-run."""
    monkeypatch.setenv("RL_NO_PROGRESS", "1")
    args = ["model_name=tiny:gpt2", f"data.path={_long_rows(tmp_path)}", "data.eval_fraction=0", *extra]
    if script == "grpo":
        args = [a for a in args if a != "data.eval_fraction=0"]
    line = fails_in_process(capsys, script, *args, "max_steps=1", f"output_dir={tmp_path / 'run'}", names=())
    assert line == "error: " + CONTEXT_LINE.format(n=2048)
    assert fails_in_process(capsys, script, *args, "--dry-run", names=()) == line


def test_pipeline_refuses_a_stage_length_above_the_context_before_sft(tmp_path, capsys):
    out = tmp_path / "p"
    line = fails_in_process(capsys, "pipeline", "tiny_family=gpt2", "grpo.max_length=2000", f"output_dir={out}",
                            names=("key 'grpo.max_length': 2000 tokens exceed", "context of 1024 positions",
                                   "set grpo.max_length=1024 or less"))
    # refused before the SFT stage trained (its output_dir may exist: a run's lock file is taken first)
    assert line and not (out / "sft" / "metrics.jsonl").exists() and not (out / "sft" / "model.safetensors").exists()


def test_short_batch_weights_give_the_exact_step_mean():
    """DPO: 3 pairs in a step of 2 processes x 2 micro-batches, split [2], [1] / [0 (padding)], [] :
    sum over micro-batches of loss / accumulation, then the mean over processes (what the engine and
    DDP do) equals the mean of the 3 per-pair losses, with the weights train_step gives."""
    from rl.trainers.dpo import dpo_batch_loss

    torch.manual_seed(0)
    V, T = 11, 5
    logits = torch.randn(3, 2, T, V)  # pair, chosen/rejected, positions, vocab
    labels = torch.randint(0, V, (3, 2, T))
    labels[:, :, 0] = -100
    ref = torch.randn(3, 2)
    kw = dict(loss_type="sigmoid", beta=0.1)

    def loss_of(pairs, weight):
        lg = torch.cat([logits[pairs, 0], logits[pairs, 1]])
        lb = torch.cat([labels[pairs, 0], labels[pairs, 1]])
        out, _ = dpo_batch_loss(lg, lb, torch.ones_like(lb), ref_chosen_logps=ref[pairs, 0],
                                ref_rejected_logps=ref[pairs, 1], pair_weight=weight, **kw)
        return out

    full = [float(loss_of([i], None)) for i in range(3)]
    world, N = 2, 2
    unit = world * N / 3
    rank0 = (loss_of([0, 1], torch.full((2,), unit)) + loss_of([2], torch.full((1,), unit))) / N
    rank1 = (loss_of([0], torch.zeros(1)) + loss_of([0], torch.zeros(1))) / N
    assert abs(float((rank0 + rank1) / world) - sum(full) / 3) < 1e-6
    # full micro-batches: the weights reduce to the plain mean
    assert abs(float(loss_of([0, 1], torch.full((2,), 0.5))) - float(loss_of([0, 1], None))) < 1e-6


def test_epoch_plan_keeps_a_short_last_batch():
    from rl.config.plan import epoch_plan
    from rl.trainers.dpo import DPOConfig

    cfg = DPOConfig(model_name="x", per_device_train_batch_size=8, gradient_accumulation_steps=2)
    plan = epoch_plan(cfg, 2, 1, "pairs")
    assert (plan["steps_per_epoch"], plan["last_batch"], plan["total_steps"]) == (1, 2, 1)
    assert "2 training pairs" in plan["warning"] and "16" in plan["warning"]
    plan = epoch_plan(cfg, 35, 2, "pairs")  # global batch 32: one full step and one of 3
    assert (plan["steps_per_epoch"], plan["last_batch"]) == (2, 3)
    assert epoch_plan(cfg, 64, 2)["warning"] is None
    with pytest.raises(ConfigError):
        epoch_plan(cfg, 0, 1)


@pytest.mark.parametrize("script,extra", [
    ("dpo", ["data.max_examples=2", "data.eval_fraction=0", "eval_steps=0", "per_device_train_batch_size=8",
             "gradient_accumulation_steps=2", "num_train_epochs=1"]),
    ("sft", ["data.max_examples=3", "per_device_train_batch_size=8", "gradient_accumulation_steps=2", "max_steps=2"]),
    ("reward", ["data.max_examples=2", "data.eval_fraction=0", "per_device_train_batch_size=8", "gradient_accumulation_steps=2",
                "num_train_epochs=1"]),
])
def test_fewer_examples_than_one_global_batch_train_with_one_warning(tmp_path, script, extra, capfd, monkeypatch):
    """Issue 15 point 3: the reference doc's DPO example (2 pairs, per_device_train_batch_size=8, accumulation 2). The
    launch script's main() in this process (conftest.run_main: no Python start-up per run)."""
    code, stdout, stderr = run_main(script, _argv(script, *extra, f"output_dir={tmp_path}", "report_to=[jsonl]",
                                                  "logging_steps=1"), capfd, monkeypatch)
    assert code == 0, stdout + stderr
    warnings = [line for line in (stdout + stderr).splitlines() if "warning:" in line and "global batch" in line]
    assert len(warnings) == 1, stdout + stderr
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.slow
@pytest.mark.parametrize("script,extra", [
    ("dpo", ["data.max_examples=19", "data.eval_fraction=0", "eval_steps=0", "num_train_epochs=2"]),
])
def test_short_last_batch_two_processes_match_one(tmp_path, script, extra, capfd, monkeypatch):
    """19 examples, global batch 16: one full step and one of 3 per epoch. Under 2 ZeRO-3 processes x 2
    micro-batches of 4 the short step leaves rank 1 an empty micro-batch (a zero-weight forward); the
    loss curve equals one process's (8 x 2) to 1e-5. The one-process run is the launch script's main()
    in this process (conftest.run_main); the ZeRO-3 run is `accelerate launch`. SFT's case is part of
    tests/unit/trainers/test_sft.py::test_two_processes_match_one (DDP and ZeRO-3)."""
    from tests.conftest import accelerate_cmd, run_cmd

    common = ["--config", f"recipes/tiny/{script}.yaml", *extra, "logging_steps=1", "report_to=[jsonl]",
              "gradient_accumulation_steps=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    code, stdout, stderr = run_main(script, [*common, "per_device_train_batch_size=8", f"output_dir={one}"], capfd, monkeypatch)
    assert code == 0, (stdout + stderr)[-3000:]
    run_cmd(accelerate_cmd(f"launch/{script}.py", *common, "per_device_train_batch_size=4", f"output_dir={two}", zero3=True))

    def losses(out):
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return [r["loss"] for r in rows if "loss" in r]

    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_model_problem_tells_paths_from_hub_ids(tmp_path, monkeypatch):
    """Hub ids ('gpt2', 'org/name') are left to the loader; what can only be a local path must exist."""
    from rl.scripts.common import model_problem

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for hub_id in ("gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B"):
        assert model_problem("model_name", hub_id) is None, hub_id
    for path in ("runs/sft", "./model", "/no/such/model", "a/b/c", "~/no-such-model-dir"):
        assert "does not exist" in model_problem("model_name", path), path
    assert "does not exist" in model_problem("reward_model_path", "org/reward-model", "reward")


def test_ppo_with_a_correctness_reward_and_eval_data_trains_evaluates_and_saves(tmp_path, tiny_llama, capfd,
                                                                                 monkeypatch):
    """`reward_fn=correctness` reads each prompt row's `answer`: the eval rows keep their columns too (they
    were dropped, so evaluation stopped with "metadata[0] has no 'answer' key" and nothing was saved)."""
    import json

    rows = [{"text": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(3)]
    for name, part in (("train", rows[:8]), ("eval", rows[8:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    out = tmp_path / "run"
    code, stdout, stderr = run_main("ppo", [
        "--config", "recipes/tiny/ppo.yaml", f"data.path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'eval.jsonl'}", "reward_fn=correctness", "custom_reward=null",
        "per_device_train_batch_size=4", "mini_batch_size=4", "gradient_accumulation_steps=1", "num_ppo_epochs=1", "max_completion_length=4",
        "max_steps=2", "eval_steps=1", "report_to=[jsonl]", f"output_dir={out}"], capfd, monkeypatch)
    assert code == 0, (stdout + stderr)[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/scores" in m for m in metrics), metrics
    assert (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------------ a full disk

def _no_space_on_write(monkeypatch, target, attr: str, when):
    """`target.attr` (a writer) raises the full disk's error, in the words a real 64 KiB tmpfs gave, when
    `when(path)` holds; otherwise it writes."""
    import errno

    from safetensors import SafetensorError

    real = getattr(target, attr)

    def full(*args, **kwargs):
        path = next((a for a in args if isinstance(a, (str, Path))), "")
        if when(str(path)):
            if attr == "safe_save_file":
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, attr, full)


def test_disk_full_at_the_final_save_is_one_line(tmp_path, capfd, monkeypatch):
    """Issue 39 point 4: the final model's safetensors write failing on a full disk (the checkpoint before it
    written) is one `error:` line naming output_dir and the fix, exit 1 (it was safetensors' traceback)."""
    import transformers.modeling_utils as mu

    out = tmp_path / "run"
    _no_space_on_write(monkeypatch, mu, "safe_save_file", lambda p: "checkpoint" not in p)
    code, stdout, stderr = run_main("sft", _argv("sft", "max_steps=1", "save_steps=1", "per_device_train_batch_size=4",
                                                 f"output_dir={out}", "report_to=[jsonl]"), capfd, monkeypatch)
    lines = _error_lines(stderr)
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stdout + stderr
    assert lines[0].startswith(f"error: no space left on {out} while writing the final model")
    assert "free space, then rerun with resume=auto" in lines[0]
    assert (out / "checkpoints" / "checkpoint-1" / "COMPLETE").exists()


def test_disk_full_when_the_resolved_config_is_written_is_one_line(tmp_path, capfd, monkeypatch):
    """Issue 39 point 4: the run's first write, `<output_dir>/config.yaml`, on a full disk: one `error:` line
    naming the file, exit 1 (it was the OSError's traceback)."""
    import errno

    out = tmp_path / "run"
    real = Path.write_text

    def write_text(self, *a, **k):
        if self.name == "config.yaml":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", write_text)
    code, stdout, stderr = run_main("sft", _argv("sft", "max_steps=1", f"output_dir={out}"), capfd, monkeypatch)
    lines = _error_lines(stderr)
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stdout + stderr
    assert lines[0] == (f"error: no space left on {out} while writing {out / 'config.yaml'}; free space there "
                        f"or choose another output_dir")


def test_disk_full_during_training_is_one_line(tmp_path, capfd, monkeypatch):
    """A full disk in a write of the run's own between checkpoints (a metrics.jsonl row) is one `error:` line
    naming output_dir and resume=auto, exit 1."""
    import errno

    from rl.engine.tracking import Tracker

    def log(self, step, metrics):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Tracker, "log", log)
    out = tmp_path / "run"
    code, stdout, stderr = run_main("sft", _argv("sft", "max_steps=1", f"output_dir={out}"), capfd, monkeypatch)
    lines = _error_lines(stderr)
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stdout + stderr
    assert lines[0] == (f"error: no space left on {out} during training ([Errno 28] No space left on device); "
                        f"free space, then rerun with resume=auto to continue from the newest checkpoint")
