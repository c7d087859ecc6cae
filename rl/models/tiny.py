r"""Tiny offline models: a byte-level tokenizer and a small causal LM or sequence classifier.

Nothing here downloads anything. The model is built from a config with random weights, saved with
`save_pretrained`, and meant to be loaded back through `AutoTokenizer` / `AutoModelForCausalLM` /
`AutoModelForSequenceClassification`, which is the same loading path a real checkpoint takes. The
tokenizer has one token per byte plus pad/bos/eos (259 ids) and a chat template that renders any role,
`tool` included, as `<|role|>\ncontent\n`. `write_tiny_model` is idempotent per spec and safe when
several processes build the same model at once (a lock file, a temporary directory renamed into
place); `without_zero3_init` lets it, and other local builds, run inside a ZeRO-3 launch.

    python -m rl.models.tiny --family llama --out /tmp/tiny-llama
    python -m rl.models.tiny --family qwen2 --task classifier --out /tmp/tiny-rm
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

FAMILIES = ("llama", "qwen2", "gemma", "gpt2")
TASKS = ("causal-lm", "classifier")
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
TOKENIZER_VERSION = 2

# A minimal chat template so chat-format data ({"messages": [...]}) renders with the tokenizer's
# own `apply_chat_template`, exactly as it would with a real instruct model.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer():
    """Byte-level BPE tokenizer with no merges: one token per byte, plus pad/bos/eos (259 ids).

    Its post-processor puts BOS first, as Llama's tokenizer does, so `tok(prompt)` gives the ids the
    trainers build (`rl.data.records.with_bos` over `add_special_tokens=False`) and `tok(prompt)` + `generate`
    on a saved tiny model behaves as in training (without it, "41+2=" was a prompt never seen)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {sym: i for i, sym in enumerate(sorted(alphabet))}
    for tok in SPECIAL_TOKENS.values():
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS["bos_token"]
    core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1",
                                                         special_tokens=[(bos, vocab[bos])])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **SPECIAL_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                 max_positions: int = 1024, task: str = "causal-lm", pad_id: int = 0,
                 bos_id: int = 1, eos_id: int = 2, head_dim: int | None = None):
    """A transformers config of the given family, `hidden` wide and `layers` deep; `head_dim` None: hidden / heads
    (else the attention projections are heads x head_dim wide, as in Gemma or Qwen3)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    common = dict(vocab_size=vocab_size, pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id)
    if family == "gpt2":
        if head_dim:
            raise ValueError("gpt2's head_dim is hidden / heads; choose another family for head_dim")
        cfg = AutoConfig.for_model("gpt2", n_embd=hidden, n_layer=layers, n_head=heads,
                                   n_positions=max_positions, **common)
    else:
        extra = dict(hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                     max_position_embeddings=max_positions, tie_word_embeddings=True)
        if family == "gemma" or head_dim:
            extra["head_dim"] = head_dim or hidden // heads
        cfg = AutoConfig.for_model(family, **extra, **common)
    if task == "classifier":
        cfg.num_labels = 1
    return cfg


def write_tiny_model(out: str | os.PathLike, family: str = "llama", task: str = "causal-lm",
                     hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                     head_dim: int | None = None) -> Path:
    """Write tokenizer + randomly initialised model to `out` and return the path (`head_dim`: see `build_config`;
    vLLM's CPU attention needs 32, 64, 80, ... where hidden / heads is 16).

    Idempotent: if `out` already holds a model written with the same arguments, it is reused.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if family not in FAMILIES:  # before anything is written: no half-built directory is left behind
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")
    out = Path(out)
    # `tokenizer` versions the tokenizer's build, so a cached model from before a change is rebuilt
    # (2: the post-processor adds BOS); the weights depend only on the other fields.
    spec = dict(family=family, task=task, hidden=hidden, layers=layers, heads=heads, seed=seed,
                tokenizer=TOKENIZER_VERSION, **({"head_dim": head_dim} if head_dim else {}))
    marker = out / "tiny_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    # Several processes (an `accelerate launch` of 2) may build the same model at once. They take turns
    # on a lock file: the first builds into a temporary directory and renames it into place, the others
    # then find the marker. (Without the lock, one process could move aside the model another had just
    # renamed into place while a third was loading it: seen as a directory with tokenizer files only.)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text()) == spec:
            return out  # another process finished the same model first
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            _build_into(tmp, family, task, hidden, layers, heads, seed, spec, head_dim)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out.exists():  # an incomplete model, or one with another spec: replace it
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, out)
    return out


def _build_into(tmp: Path, family: str, task: str, hidden: int, layers: int, heads: int, seed: int,
                spec: dict, head_dim: int | None = None) -> None:
    """Write the tiny model's config, weights, tokenizer and spec marker into `tmp`."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tok = build_tokenizer()
    # Headroom above the 259 tokens: some families' tokenizer classes (Qwen2's) add a special token of
    # their own on load, and a multiple of 64 keeps the embedding matmuls aligned.
    vocab_size = 320
    cfg = build_config(family, vocab_size, hidden, layers, heads, task=task, pad_id=tok.pad_token_id,
                       bos_id=tok.bos_token_id, eos_id=tok.eos_token_id, head_dim=head_dim)
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if task == "classifier" else AutoModelForCausalLM
    with without_zero3_init():
        model = cls.from_config(cfg)
    # Written piece by piece, not with model.save_pretrained: that writes only on torch.distributed
    # rank 0, and under `accelerate launch` the rank that takes the lock first may be another one
    # (seen: a directory with the tokenizer and nothing else).
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp)
    if model.can_generate():
        model.generation_config.save_pretrained(tmp)
    # tied weights (lm_head = embeddings) are stored once, under the embedding's name, as
    # save_pretrained does: a base model (AutoModel) must find its embeddings
    tied = getattr(model, "_tied_weights_keys", None) or {}
    save_torch_state_dict({k: v for k, v in model.state_dict().items() if k not in tied}, tmp)
    tok.save_pretrained(tmp)
    (tmp / "tiny_spec.json").write_text(json.dumps(spec))


@contextlib.contextmanager
def without_zero3_init():
    """Build the full tiny model locally even inside a ZeRO-3 run.

    Under `accelerate launch --use_deepspeed` transformers would build it with `zero.Init`, a
    collective; but only the process that finds no cached model builds one, so the other would
    never join and the run would hang."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:  # pragma: no cover
        yield
        return
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m rl.models.tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="llama", help="model family (default llama)")
    p.add_argument("--task", choices=TASKS, default="causal-lm", help="causal-lm or classifier")
    p.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--layers", type=int, default=2, help="number of layers (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    p.add_argument("--head-dim", type=int, default=None, help="dimensions per head (default hidden / heads; vLLM's "
                   "CPU build takes 32, 64, 80, ...)")
    a = p.parse_args(argv)
    path = write_tiny_model(a.out, a.family, a.task, a.hidden, a.layers, a.heads, a.seed, a.head_dim)
    print(f"wrote tiny {a.family} {a.task} to {path}")


if __name__ == "__main__":
    main()
