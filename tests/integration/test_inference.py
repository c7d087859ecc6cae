"""Trying a result: rl/scripts/inference.py and the launch/chat.py, launch/eval.py commands, on tiny models.

Nothing here asserts which tokens a random tiny model writes: completions are cross-checked against
transformers' own greedy `generate` on the same ids, and rewards against `answers_match` recomputed."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
import torch

from rl.rewards import answers as R
from rl.rewards import functions as RF


def _launch(name: str):
    """The code behind launch/<name>.py."""
    return importlib.import_module(f"rl.scripts.{name}")


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    from rl.scripts.inference import load_for_inference

    return load_for_inference(tiny_llama, dtype="float32")


def test_encode_matches_training_and_greedy_matches_transformers(loaded, tiny_llama):
    """`encode` gives the ids GRPO trains on (plain and chat), and `complete` decodes what HF's greedy
    `generate` writes for those ids (left-padded batch included)."""
    from rl.rollout.prompts import encode_prompt
    from rl.scripts.inference import complete, encode

    model, tok = loaded
    for chat in (False, True):
        assert encode(tok, "12+7=", chat) == encode_prompt(tok, "12+7=", 10_000, chat)
    ids = encode(tok, "12+7=", False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    # the saved tiny tokenizer adds BOS itself (its post-processor), so a plain `tok(prompt)` is the
    # training prompt, and code that also adds BOS (with_bos) does not double it
    from rl.data.chat import with_bos

    assert tok("12+7=")["input_ids"] == ids == with_bos(tok, tok("12+7=")["input_ids"])
    assert tok("12+7=", add_special_tokens=False)["input_ids"] == ids[1:]
    prompts = [encode(tok, p, False) for p in ("12+7=", "hello there, ")]
    got = complete(model, tok, prompts, max_new_tokens=6, temperature=0.0, batch_size=1)
    want = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        want.append(tok.decode(out[0, len(p):], skip_special_tokens=True))
    assert got == want
    assert complete(model, tok, prompts, max_new_tokens=6, batch_size=2) == got  # batching changes nothing


def test_adapter_directory_loads_as_base_plus_merged_adapter(tmp_path, loaded, tiny_llama):
    from peft import LoraConfig, get_peft_model

    from rl.models.loading import load_causal_lm
    from rl.scripts.inference import load_for_inference

    base = load_causal_lm(tiny_llama, dtype="float32")
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))  # random B: the adapter matters
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    assert (adapter_dir / "adapter_config.json").exists() and not (adapter_dir / "config.json").exists()
    model, tok = load_for_inference(str(adapter_dir), dtype="float32")
    x = torch.tensor([[tok.bos_token_id, 49, 50, 43]])
    with torch.no_grad():
        want = peft_model(x).logits
        got = model(x).logits
        plain = loaded[0](x).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # not silently the base model


def test_load_errors_are_one_line(tmp_path):
    from rl.errors import ConfigError
    from rl.scripts.inference import load_for_inference

    with pytest.raises(ConfigError, match="no model here"):
        load_for_inference(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a PEFT adapter config"):
        load_for_inference(str(tmp_path))


def test_chat_setting_follows_the_run(tmp_path):
    from rl.scripts.inference import chat_setting

    assert chat_setting(str(tmp_path), "auto", default=True) is True  # no config.yaml: the caller's default
    (tmp_path / "config.yaml").write_text("chat_template: false\n")
    assert chat_setting(str(tmp_path), "auto", default=True) is False
    assert chat_setting(str(tmp_path), "yes", default=False) is True


def test_eval_scores_and_writes_per_example_json(tmp_path, tiny_llama, capsys):
    data = tmp_path / "heldout.jsonl"
    data.write_text('{"prompt": "12+7=", "answer": 19}\n{"problem": "x", "prompt": "3+4=", "answer": "7"}\n'
                    '{"prompt": "1+1=", "answer": "2"}\n')
    out = tmp_path / "eval.json"
    _launch("eval").main(["--model", tiny_llama, "--model", "tiny:qwen2", "--data", str(data),
                          "--max-completion-length", "4", "--out", str(out), "--per-device-eval-batch-size", "2"])
    printed = capsys.readouterr().out.splitlines()
    runs = json.loads(out.read_text())["runs"]
    assert [r["model"] for r in runs] == [tiny_llama, "tiny:qwen2"]
    for res, line in zip(runs, printed):
        assert res["n"] == 3 and [e["line"] for e in res["examples"]] == [1, 2, 3]
        for e in res["examples"]:  # the reward is the trainers' checker on this completion
            assert e["reward"] == float(R.answers_match(e["completion"], e["answer"]))
        assert res["accuracy"] == sum(e["correct"] for e in res["examples"]) / 3
        assert line.startswith(f"accuracy {res['accuracy']:.3f} ({res['correct']}/3)")


def test_eval_score_hand_computed():
    ev = _launch("eval")
    examples = [{"prompt": p, "answer": a, "meta": {"answer": a}, "_line": i}
                for i, (p, a) in enumerate([("q", "19"), ("q", "\\frac{\\pi}{2}"), ("q", "3"), ("q", "4")], 1)]
    completions = ["Answer: 19", "\\boxed{\\pi/2}", "Answer: 3 or 4", "5"]
    res = ev.score(RF.get_reward_fn("correctness"), examples, completions, threshold=1.0)
    assert [e["correct"] for e in res["examples"]] == [True, True, False, False]
    assert (res["accuracy"], res["correct"], res["mean_reward"]) == (0.5, 2, 0.5)


def test_eval_and_chat_bad_input_exit_2(tmp_path, tiny_llama, capsys):
    ev, chat = _launch("eval"), _launch("chat")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "solution": "2"}\n')
    cases = [(ev, ["--model", tiny_llama, "--data", str(data)], "missing column 'answer'"),
             (ev, ["--model", tiny_llama, "--data", str(tmp_path / "nope.jsonl")], "data file not found"),
             (ev, ["--model", tiny_llama, "--data", str(data), "--max-completion-length", "0"], "must be >= 1"),
             (chat, ["--model", str(tmp_path), "--prompt", "hi"], "no model here"),
             (chat, ["--model", tiny_llama, "--prompts-file", str(tmp_path / "none.txt")], "prompts file not found")]
    from test_data import _hub_layout_repo

    repo = _hub_layout_repo(tmp_path / "repo")
    cases.append((ev, ["--model", tiny_llama, "--data", str(repo), "--split", "dev"], "(set --split)"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    cases.append((chat, ["--model", tiny_llama, "--prompts-file", str(bad)], "bad.jsonl:2: a JSONL row needs"))
    for mod, argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and msg in err[-1], (argv, err)


def test_chat_prompts_file_and_stdin(tmp_path, tiny_llama, loaded, capsys, monkeypatch):
    from rl.scripts.inference import complete, encode

    model, tok = loaded
    chat = _launch("chat")
    prompts = tmp_path / "p.txt"
    prompts.write_text('12+7=\n{"prompt": "3+4="}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    chat.main(["--model", tiny_llama, "--prompts-file", str(prompts), "--chat-template", "no",
               "--max-completion-length", "4"])
    printed = capsys.readouterr().out
    msgs = [{"role": "user", "content": "hi"}]
    replies = complete(model, tok, [encode(tok, "12+7=", False), encode(tok, "3+4=", False), encode(tok, msgs, False)],
                       max_new_tokens=4)
    assert printed == "".join(f">>> {p}\n{r}\n\n" for p, r in zip(["12+7=", "3+4=", "hi"], replies))
    monkeypatch.setattr("sys.stdin", io.StringIO("12+7=\n\n3+4=\n"))  # not a terminal: one prompt per line
    chat.main(["--model", tiny_llama, "--chat-template", "no", "--max-completion-length", "4"])
    assert capsys.readouterr().out == f"{replies[0]}\n{replies[1]}\n"


def _one_error_line(capsys, fn, argv, code=2) -> str:
    with pytest.raises(SystemExit) as e:
        fn(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert e.value.code == code and "Traceback" not in err and lines and lines[-1].startswith("error: "), err[-2000:]
    return lines[-1]


def test_chat_and_eval_refuse_broken_or_wrong_models_in_one_line(tiny_llama, tmp_path, capsys):
    """Each class once, through the public entry points: a missing local directory (was transformers' "Repo
    id must be in the form ..."), a reward model taken for a policy (a full fine-tune: it loaded and
    answered), a truncated model.safetensors (SafetensorError), a chat template with a syntax error and one
    that tries to leave the Jinja sandbox (TemplateSyntaxError / SecurityError), a pickled adapter
    (UnpicklingError), a reward function raising anything but ValueError, `--out` naming a directory (after
    the whole evaluation ran)."""
    import json
    import shutil

    from rl.models.sources import resolve_model_path

    chat, ev = _launch("chat").main, _launch("eval").main
    line = _one_error_line(capsys, chat, ["--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert "no such file or directory" in line
    line = _one_error_line(capsys, chat, ["--model", resolve_model_path("tiny:llama-classifier"), "--prompt", "hi"])
    assert "is a reward model" in line
    cut = tmp_path / "cut"
    shutil.copytree(tiny_llama, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert f"{weights} cannot be read" in _one_error_line(capsys, chat, ["--model", str(cut), "--prompt", "hi"])
    for name, template, said in (("syntax", "{% if %}", "cannot be rendered"),
                                 ("escape", "{{ ''.__class__.__mro__ }}", "tried to leave the Jinja sandbox")):
        bad = tmp_path / name
        shutil.copytree(tiny_llama, bad)
        cfg = json.loads((bad / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
        (bad / "chat_template.jinja").unlink(missing_ok=True)
        line = _one_error_line(capsys, chat, ["--model", str(bad), "--prompt", "hi", "--chat-template", "yes"])
        assert said in line and "chat_template" in line, line
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_llama,
                                                             "peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                             "target_modules": ["q_proj"]}))
    import pickle

    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"x": shutil.Error("a pickled object, not a tensor")}))
    assert "refused to unpickle" in _one_error_line(capsys, chat, ["--model", str(adapter), "--prompt", "hi"])
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "rewards_that_break.py").write_text("def score(prompts, completions, metadata=None):\n"
                                                    "    raise KeyError('answer')\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        line = _one_error_line(capsys, ev, ["--model", tiny_llama, "--data", str(data), "--reward",
                                            "rewards_that_break:score", "--max-completion-length", "2"], code=1)
    finally:
        sys.path.remove(str(tmp_path))
    assert "raised KeyError" in line
    line = _one_error_line(capsys, ev, ["--model", tiny_llama, "--data", str(data), "--out", str(tmp_path)])
    assert "is a directory" in line


def test_chat_model_that_is_a_file_says_so_in_one_line(tiny_llama, tmp_path, capsys, monkeypatch):
    """Issue 39 point 6: `chat.py --model <a file>` (a model's config.json, any other file, by a relative
    name too) says it is a file and what is expected, naming the model folder when the file is in one (it
    was taken for a hub id: "Repo id must be in the form ...", "hf download <the local path>")."""
    from pathlib import Path

    chat = _launch("chat").main
    config = str(Path(tiny_llama) / "config.json")
    line = _one_error_line(capsys, chat, ["--model", config, "--prompt", "hi"])
    assert line == (f"error: model {config!r} is a file, not a model directory (its folder {tiny_llama} is one: "
                    f"give that); give a directory holding config.json (a run's output_dir), a .gguf file, a hub id "
                    f"or tiny:<family>")
    (tmp_path / "notes.txt").write_text("hello\n")
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(capsys, chat, ["--model", "notes.txt", "--prompt", "hi"])
    assert line.startswith("error: model 'notes.txt' is a file, not a model directory; give a directory")
    assert "hf download" not in line


def test_a_corrupt_safetensors_file_is_named(tiny_llama, tmp_path, capsys):
    """Issue 39 point 6: a truncated safetensors file is named in the one error line, not only its directory
    (safetensors' own message names no file): a model's model.safetensors cut in its data, and a LoRA
    adapter's adapter_model.safetensors cut in its header."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from rl.models.loading import load_causal_lm

    chat = _launch("chat").main
    cut = tmp_path / "cut"
    shutil.copytree(tiny_llama, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = _one_error_line(capsys, chat, ["--model", str(cut), "--prompt", "hi"])
    assert line == (f"error: model {str(cut)!r}: {weights} cannot be read (Error while deserializing header: "
                    f"incomplete metadata, file not fully covered); it is truncated or corrupt: copy or download "
                    f"it again")
    adapter = tmp_path / "adapter"
    peft_model = get_peft_model(load_causal_lm(tiny_llama, dtype="float32"),
                                LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    peft_model.save_pretrained(str(adapter))
    file = adapter / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    line = _one_error_line(capsys, chat, ["--model", str(adapter), "--prompt", "hi"])
    assert line.startswith(f"error: model {str(adapter)!r}: {file} cannot be read (Error while deserializing")

def test_chat_with_a_prompt_longer_than_the_context_keeps_its_end(tiny_cache, capsys):
    """GPT-2's 1,024 learned positions: a 1,400-token prompt crashed generation (IndexError). Now it keeps BOS
    and its last 1,024 - max_new_tokens tokens, as the trainers cut prompts, with one warning line; the reply
    is the one the already-cut prompt gets. A --max-completion-length that leaves no room is one error line."""
    from rl.rollout.prompts import encode_prompt
    from rl.scripts.inference import complete, load_for_inference

    chat = _launch("chat")
    prompt = "1+" * 700 + "1="
    chat.main(["--model", "tiny:gpt2", "--prompt", prompt, "--chat-template", "no", "--max-completion-length", "4"])
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == ["warning: 1 prompt(s) longer than tiny:gpt2's context leaves next to 4 new "
                                        "tokens keep their last 1020 tokens (lower --max-completion-length to keep more)"]
    model, tok = load_for_inference("tiny:gpt2", dtype="float32")
    cut = encode_prompt(tok, prompt, 1020)
    assert len(cut) == 1020 and cut[0] == tok.bos_token_id
    assert out == f">>> {prompt}\n{complete(model, tok, [cut], max_new_tokens=4)[0]}\n\n"
    line = _one_error_line(capsys, chat.main, ["--model", "tiny:gpt2", "--prompt", "hi", "--max-completion-length", "2000"])
    assert line == ("error: --max-completion-length 2000 leaves no room for the prompt in tiny:gpt2's context of 1024 "
                    "positions (its config's n_positions); lower --max-completion-length below 1024")
