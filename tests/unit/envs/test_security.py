"""Hostile programs against the sandbox and the code environment, and model directories that ask
for remote code: each attack gets nothing, and the honest solution still earns the full reward.

The sandbox tests need a private root (bubblewrap, installed by .ci/run); where there is none they
are skipped, and `test_without_private_root_*` checks the refusal instead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from rl.envs import isolation, sandbox
from rl.envs.code import (
    DEFAULT_CODE_PROBLEMS,
    MAX_RESULT_CHARS,
    create_code_generation_env,
    parse_unit_test,
    read_results,
    run_unit_tests,
    unit_test_passes,
)
from rl.envs.sandbox import run_python
from rl.errors import ConfigError
from tests.conftest import ROOT


@pytest.fixture(params=["bwrap", "unshare"])
def mechanism(request, monkeypatch):
    """Each private-root mechanism that works here: bubblewrap, and util-linux's unshare (the
    fallback where bubblewrap is missing)."""
    works = isolation._bwrap_works() if request.param == "bwrap" else isolation._unshare_root_works()
    if not works:
        pytest.skip(f"{request.param} cannot give the sandbox a private root here")
    if request.param == "unshare":
        monkeypatch.setattr(isolation, "_bwrap_works", lambda: False)
    return request.param


def private_run(code: str, *, mechanism: str, **kw):
    res = run_python(code, require_private_root=True, **kw)
    assert res.isolation == "private-root" and res.mechanism == mechanism
    return res


ADD = 'def add(a, b):\n    """Sum."""\n    return a + b\n'
WRONG_ADD = 'def add(a, b):\n    """Wrong."""\n    return a - b + 7\n'


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture
def secret_files(tmp_path):
    """A secret in the test's tmp_path and one in the checkout; both removed afterwards."""
    token = f"SECRET-{uuid.uuid4().hex}"
    inside_tmp = tmp_path / "secret.txt"
    inside_checkout = ROOT / f".secret-{uuid.uuid4().hex[:8]}.txt"
    inside_tmp.write_text(token)
    inside_checkout.write_text(token)
    try:
        yield token, [str(inside_tmp), str(inside_checkout)]
    finally:
        inside_checkout.unlink(missing_ok=True)


def _code_env(tok, **kw):
    return create_code_generation_env(tok, run_tests=True, timeout=3.0, **kw)


def _tests_reward(env, codes: list[str]) -> list[float]:
    """reward_tests of each code for the `add` problem, all in one batch."""
    prompt = env.prompts[0]
    assert prompt.startswith("Write a Python function add")
    _, metrics = env.score([prompt] * len(codes), codes)
    return metrics["reward_tests"]


# ------------------------------------------------------------------------------ the file system

def test_reads_outside_get_nothing(secret_files, mechanism):
    token, paths = secret_files
    targets = [*paths, str(ROOT / "rl" / "environments.py"), str(Path.home() / ".bashrc"), "/etc/passwd",
               "/work", "/home", "/root/.cache", os.environ.get("RL_TINY_CACHE", "/nonexistent")]
    code = ("import os, json\nfound = {}\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        found[p] = os.listdir(p) if os.path.isdir(p) else open(p).read()\n"
            "    except OSError as e:\n"
            "        found[p] = type(e).__name__\n"
            "print(json.dumps(found))\nprint(json.dumps(os.listdir('/')))\n")
    res = private_run(code, mechanism=mechanism)
    assert res.ok and res.isolation == "private-root", res.stderr
    found = json.loads(res.stdout.splitlines()[0])
    assert token not in res.stdout
    assert all(v == "FileNotFoundError" for p, v in found.items() if not p.startswith("/root")), found
    # Only the system, the Python installation and the sandbox's own directories exist at the root.
    assert set(json.loads(res.stdout.splitlines()[1])) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32",
                                                     "proc", "dev", "tmp", ".rl-input", *_python_roots()}


def _python_roots() -> set[str]:
    return {d.strip("/").split("/")[0] for d in isolation._python_dirs()}


def test_writes_outside_get_nothing(tmp_path, mechanism):
    name = f"pwned-{uuid.uuid4().hex[:8]}"
    targets = [str(tmp_path / name), str(ROOT / "rl" / f"{name}.py"), f"/usr/{name}", f"/{name}",
               f"/dev/{name}", f"/proc/{name}", f"{sys.base_prefix}/{name}", f"/.rl-input/{name}"]
    code = ("import os, json\nok = []\n"
            f"for p in {targets!r}:\n"
            "    try:\n"
            "        os.makedirs(os.path.dirname(p), exist_ok=True)\n"
            "        open(p, 'w').write('x')\n"
            "        ok.append(p)\n"
            "    except OSError:\n"
            "        pass\n"
            "open('mine.txt', 'w').write('allowed')\n"
            "print(json.dumps(ok))\nprint(open('mine.txt').read())\n")
    res = private_run(code, mechanism=mechanism)
    assert res.ok, res.stderr
    written, mine = res.stdout.splitlines()
    # Not even inside the sandbox, except in its private /tmp (the host's is checked below).
    assert [p for p in json.loads(written) if not p.startswith("/tmp/")] == []
    assert mine == "allowed"
    for p in targets:
        assert not os.path.exists(p), f"the sandbox created {p} on the host"


def test_disk_flood_stops_at_the_private_tmpfs(mechanism):
    code = ("n = 0\ntry:\n    for i in range(10_000):\n        open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
            "        n += 1\nexcept OSError as e:\n    print(n, e.errno)\n")
    res = private_run(code, disk_mb=16, mechanism=mechanism)
    count, errno = res.stdout.split()
    assert int(count) <= 16 and int(errno) == 28  # ENOSPC: 16 MiB in all, not the host's disk


# ------------------------------------------------------------------------------ forging the reward

FORGE_EVERYTHING = r'''
import os, re
seen = []
def grab(path):
    try:
        with open(path, "rb") as fh:
            seen.append(fh.read(200_000).decode("utf-8", "replace"))
    except OSError:
        pass
for root in [os.getcwd(), "/.rl-input", os.environ.get("HOME", "."), CHECKOUT]:
    for dirpath, _, names in os.walk(root):
        for n in names:
            grab(os.path.join(dirpath, n))
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for part in ("cmdline", "environ"):
            grab(f"/proc/{pid}/{part}")
seen.append(repr(dict(os.environ)))
text = "\n".join(seen)
# Forge: print a result line per `add(...) == value` found anywhere, and every old-style marker.
values = re.findall(r"assert add\([^)]*\) == (-?\d+)", text)
for i, v in enumerate(values[:3]):
    print("\n__rl_result__ " + '{"i": %d, "repr": "%s"}' % (i, v))
for m in set(re.findall(r"__rl_test_[0-9a-f]+_\d+:", text)):
    print(m)
def add(a, b):
    return a - b + 7
'''


def test_forging_the_unit_test_reward_earns_nothing(tok, mechanism):
    env = _code_env(tok)
    forge = FORGE_EVERYTHING.replace("CHECKOUT", repr(str(ROOT)))
    old_attack = ("import sys\nsrc = open(sys.argv[0]).read()\n"  # the attack that beat the old marker scheme
                  "import re\nfor m in re.findall(r\"'(__rl_test_\\w+:)'\", src):\n    print(m)\n" + WRONG_ADD)
    guess = ("import sys\nfor i in range(3):\n    print('__rl_result__ {\"i\": %d, \"repr\": \"5\"}' % i)\n"
             "sys.stdout.flush()\nimport os\nos._exit(0)\n" + WRONG_ADD)
    rewards = _tests_reward(env, [ADD, forge, old_attack, guess, WRONG_ADD])
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_the_forging_attack_is_real_without_a_private_root(monkeypatch):
    # Proof that the attack above can win: seeing the host's files (no private root), it reads the
    # built-in tests in rl/environments.py and earns the full reward with a wrong add.
    monkeypatch.setattr(isolation, "private_root_available", lambda: False)
    forge = FORGE_EVERYTHING.replace("CHECKOUT", repr(str(ROOT / "rl")))
    assert run_unit_tests(forge, DEFAULT_CODE_PROBLEMS[0]["tests"], require_private_root=False) == 1.0


def test_result_lines_are_judged_here():
    t = parse_unit_test("assert add(1, 2) == 3")
    lines = "\n".join(['__rl_result__ {"i": 0, "repr": "3"}', '__rl_result__ {"i": 0, "repr": "4"}',
                       '__rl_result__ {"i": true, "repr": "3"}', '__rl_result__ {"i": 1, "repr": "3"}',
                       '__rl_result__ [1]', "__rl_result__ " + "[" * 100_000])
    results = read_results(lines, 2)
    assert results[0] == {"i": 0, "repr": "3"} and results[1] == {"i": 1, "repr": "3"}  # first line per call
    assert unit_test_passes(t, {"repr": "3"}) and not unit_test_passes(t, {"repr": "3.5"})
    for forged in ({"repr": "__import__('os')"}, {"repr": "X()"}, {"error": "AssertionError"}, None,
                   {"repr": "3" * (MAX_RESULT_CHARS + 1)}, {"repr": 3}):
        assert not unit_test_passes(t, forged)


# ------------------------------------------------------------------------------ network

def test_network_gets_nothing(mechanism):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    abstract = socket.socket(socket.AF_UNIX)
    name = f"rl-test-{uuid.uuid4().hex[:8]}"
    abstract.bind("\0" + name)
    abstract.listen(1)
    try:
        code = ("import _socket\nfor fam, addr in [(_socket.AF_INET, ('1.1.1.1', 80)), "
                f"(_socket.AF_INET, ('127.0.0.1', {server.getsockname()[1]})), (_socket.AF_UNIX, '\\0{name}')]:\n"
                "    s = _socket.socket(fam, _socket.SOCK_STREAM)\n    s.settimeout(1)\n"
                "    try:\n        s.connect(addr)\n        print('connected', addr)\n"
                "    except OSError as e:\n        print('refused', type(e).__name__)\n")
        res = private_run(code, mechanism=mechanism)
    finally:
        server.close()
        abstract.close()
    assert res.ok, res.stderr
    assert "connected" not in res.stdout and res.stdout.count("refused") == 3


# ------------------------------------------------------------------------------ processes

def _host_processes_with(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def test_fork_bomb_is_bounded(mechanism):
    marker = f"bomb{uuid.uuid4().hex[:8]}"
    count = ("import os, time\nn = 0\nfor _ in range(500):\n    try:\n        pid = os.fork()\n"
             "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
             "    n += 1\nprint(n)\n")
    res = private_run(count, timeout=5, max_processes=16, mechanism=mechanism)
    if sandbox._pids_cgroup_parent() is not None or os.getuid() != 0:
        assert int(res.stdout) < 16  # the pids cgroup (or RLIMIT_NPROC in the user namespace) stops it
    bomb = f"# {marker}\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = private_run(bomb, timeout=2, mechanism=mechanism)
    assert res.timed_out  # the bomb never ends by itself: only the 2 s timeout ended it (no wall-clock bound here)
    time.sleep(0.2)
    assert _host_processes_with(marker) == []  # the PID namespace took every copy with it
    assert run_python("print('fine')").stdout.strip() == "fine"


def test_killing_the_parent_or_everyone_gets_nothing(mechanism):
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        code = (f"import os, signal\nfor pid in ({os.getpid()}, {sentinel.pid}, -1, os.getppid()):\n"
                "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n"
                "        print(type(e).__name__, flush=True)\nprint('done')\n")
        res = private_run(code, mechanism=mechanism)
        assert sentinel.poll() is None, "a process outside the sandbox was killed"
    finally:
        sentinel.kill()
        sentinel.wait()
    assert run_python("print('fine')").stdout.strip() == "fine"
    # The trainer and the sentinel do not exist in its PID namespace, and kill(-1) reaches only the
    # sandbox's own processes. Its parent: under bwrap the namespace's init, which ignores SIGKILL;
    # under unshare the program is that init and getppid() is 0, so it kills its own process group.
    out = res.stdout.split()
    assert out[:2] == ["ProcessLookupError", "ProcessLookupError"], res.stderr
    if mechanism == "bwrap":
        assert res.ok and out[-1] == "done"


# ------------------------------------------------------------------------------ resources and secrets

def test_memory_time_and_output_limits_hold_in_the_private_root(mechanism):
    res = private_run("x = bytearray(4 * 1024 ** 3)", memory_mb=256, mechanism=mechanism)
    assert not res.ok and "MemoryError" in res.stderr
    res = private_run("while True:\n    pass", timeout=1.0, cpu_seconds=30, mechanism=mechanism)
    assert res.timed_out  # an endless loop, ended by the 1 s timeout (the CPU limit of 30 s is far away)
    res = private_run("import os\nwhile True:\n    os.write(1, b'x' * 65536)", timeout=2, max_output_bytes=10_000,
                      mechanism=mechanism)
    assert len(res.stdout) <= 10_000 and not res.ok


def test_environment_secrets_are_not_visible(monkeypatch, mechanism):
    token = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", token)
    code = ("import os, json\nprint(json.dumps(sorted(os.environ)))\n"
            "for p in os.listdir('/proc'):\n    if p.isdigit():\n"
            "        try:\n            print(open(f'/proc/{p}/environ').read())\n        except OSError:\n"
            "            pass\n")
    res = private_run(code, mechanism=mechanism)
    assert res.ok, res.stderr
    assert token not in res.stdout
    assert set(json.loads(res.stdout.splitlines()[0])) <= {"HOME", "LANG", "PATH", "TMPDIR", "PWD"}


def test_every_attack_in_the_code_env_gets_nothing_and_the_honest_solution_everything(tok, secret_files, mechanism):
    token, paths = secret_files
    env = _code_env(tok)
    attacks = [
        f"print(open({paths[0]!r}).read())\n" + WRONG_ADD,                   # read outside
        f"open({str(ROOT / 'rl' / 'pwned.py')!r}, 'w').write('x')\n" + WRONG_ADD,  # write outside
        "import _socket\n_socket.socket().connect(('1.1.1.1', 80))\n" + ADD,  # network, then a correct add
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "x = bytearray(8 * 1024 ** 3)\n" + ADD,
        "while True:\n    pass\n" + ADD,
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n" + ADD,
        "import os\nos.kill(os.getppid(), 9)\n" + WRONG_ADD,
        "import os\nprint(os.environ)\n" + WRONG_ADD,
    ]
    rewards, metrics = env.score([env.prompts[0]] * (1 + len(attacks)), [ADD, *attacks])
    assert metrics["reward_tests"] == [1.0] + [0.0] * len(attacks)
    assert rewards[0] == pytest.approx(1.0 + 0.1 * 1.0 + 1.0)  # syntax + 0.1 * style + tests, all full
    assert not (ROOT / "rl" / "pwned.py").exists()


# ------------------------------------------------------------------------------ without a private root

def test_without_private_root_the_code_env_refuses_unless_unisolated(tok, monkeypatch, caplog):
    monkeypatch.setattr(isolation, "isolation_level", lambda: "network")
    with pytest.raises(ConfigError, match=r"^sandbox: .*bubblewrap.*sandbox: unisolated$"):
        _code_env(tok)
    with pytest.raises(RuntimeError, match="private root"):
        run_python("print(1)", require_private_root=True)
    create_code_generation_env(tok)  # no unit tests, nothing to refuse
    with caplog.at_level(logging.WARNING, logger="rl.envs.code"):
        env = _code_env(tok, sandbox="unisolated")
    lines = [r.getMessage() for r in caplog.records if "unisolated" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert _tests_reward(env, [ADD, WRONG_ADD]) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="sandbox"):
        _code_env(tok, sandbox="maybe")


def test_without_a_private_root_the_limits_still_hold(monkeypatch):
    monkeypatch.setattr(isolation, "private_root_available", lambda: False)
    res = run_python("import os\nprint(os.path.exists('/work') or os.path.exists('/usr'))")
    assert res.ok and res.isolation in ("network", "none") and not res.filesystem_isolated
    assert res.stdout.strip() == "True"  # the host's file system: why the code env refuses this level
    res = run_python("x = bytearray(4 * 1024 ** 3)", memory_mb=256)
    assert "MemoryError" in res.stderr


# ------------------------------------------------------------------------------ remote code

EVIL = "open({marker!r}, 'w').write('ran')\n"


def _arm(directory: Path, marker: Path) -> None:
    """Make `directory` ask for its own code: auto_map in config.json and tokenizer_config.json, an
    evil.py that writes `marker` on import, trust_remote_code in reward_config.json when present."""
    (directory / "evil.py").write_text(EVIL.format(marker=str(marker)))
    cfg = json.loads((directory / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                       "AutoModelForSequenceClassification": "evil.EvilModel"}
    (directory / "config.json").write_text(json.dumps(cfg))
    tok_cfg = directory / "tokenizer_config.json"
    if tok_cfg.exists():
        t = json.loads(tok_cfg.read_text())
        t["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
        tok_cfg.write_text(json.dumps(t))
    rc = directory / "reward_config.json"
    if rc.exists():
        meta = json.loads(rc.read_text())
        meta["config"]["trust_remote_code"] = True
        rc.write_text(json.dumps(meta))


def test_model_and_reward_model_directories_cannot_enable_remote_code(tmp_path, tiny_llama, caplog, monkeypatch):
    from rl.models.loading import load_causal_lm, load_tokenizer
    from rl.models.reward import RewardModel, RewardModelConfig, load_reward_model
    from rl.models.tiny import write_tiny_model
    from rl.scripts.dryrun import load_model_config

    marker = tmp_path / "remote-code-ran"
    model_dir = write_tiny_model(tmp_path / "model")
    _arm(model_dir, marker)
    rm = RewardModel(RewardModelConfig(model_name=tiny_llama, use_lora=False, dtype="float32"),
                     tokenizer=load_tokenizer(tiny_llama))
    rm_dir = rm.save(tmp_path / "rm")
    _arm(rm_dir, marker)
    with caplog.at_level(logging.WARNING, logger="rl.trainers.reward"):
        loaded = load_reward_model(rm_dir)
    assert "trust_remote_code; ignored" in caplog.text
    assert loaded.score(["hello"]).shape == (1,)
    load_causal_lm(str(model_dir))
    load_causal_lm(str(model_dir), task="classifier")
    load_tokenizer(str(model_dir))
    load_model_config(str(model_dir))
    assert not marker.exists(), "a model directory ran its own code"

    # The trap is armed: the user's own trust_remote_code=True does import evil.py.
    import transformers.dynamic_module_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(Exception):  # noqa: B017 - evil.py defines no classes; importing it is the point
        load_reward_model(rm_dir, trust_remote_code=True)
    assert marker.exists()


def test_a_downloaded_model_type_with_custom_code_is_refused(tmp_path):
    from rl.models.loading import load_causal_lm
    from rl.models.tiny import write_tiny_model

    marker = tmp_path / "remote-code-ran"
    model_dir = write_tiny_model(tmp_path / "model")
    _arm(model_dir, marker)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "not-a-transformers-model"  # only its own code could load it
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="custom code"):
        load_causal_lm(str(model_dir))
    assert not marker.exists()


class _Payload:
    """Unpickling this runs code: what a checkpoint or recipe from elsewhere could carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_checkpoints_and_recipes_run_no_code(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    from rl.config.parse import load_recipe
    from rl.engine.pipeline import ForwardBackwardPipeline

    marker = tmp_path / "payload-ran"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    pipe = ForwardBackwardPipeline(model, device="cpu", optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   checkpoint_dir=tmp_path / "ckpt")
    path = Path(pipe.save_state("step-1")["path"])
    torch.save(_Payload(marker), path / "optimizer.pt")  # a pickle with a payload in place of the state
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        pipe.load_state(path)
    assert not marker.exists()

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"lr: !!python/object/apply:exec [\"open({str(marker)!r}, 'w').write('ran')\"]\n")
    with pytest.raises(ConfigError, match="recipe.yaml"):
        load_recipe(str(recipe))
    assert not marker.exists()

    torch.load(path / "optimizer.pt", weights_only=False)  # the payload is real: a plain unpickle runs it
    assert marker.exists()
