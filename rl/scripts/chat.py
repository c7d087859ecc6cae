"""Talk to a model: any run's output directory (full model or PEFT adapter), a hub id or tiny:llama.

    python launch/chat.py --model runs/sft                        # interactive: type, Enter; /reset, /exit
    python launch/chat.py --model runs/sft --prompt "What is 2+3?"
    python launch/chat.py --model runs/grpo --prompts-file prompts.jsonl --chat-template no
    echo "12+7=" | python launch/chat.py --model runs/grpo --chat-template no

Prompts are tokenised as the trainers tokenise them (BOS once, then the prompt; with the chat template,
a user turn and the assistant header). Interactive chat keeps the conversation (with the chat
template); `/reset` starts over. Input that is not a terminal is read one prompt per line. A prompt longer
than the model's context leaves next to --max-new-tokens keeps its last tokens (one warning line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rl.config.vocabulary import add_alias_flag
from rl.engine.dist import run_as_program
from rl.errors import ConfigError
from rl.models.limits import prompt_room
from rl.scripts.common import fail
from rl.scripts.inference import chat_setting, complete, encode, load_for_inference


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/chat.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a run's output directory (full model, or a PEFT adapter directory with "
                        "adapter_config.json), a hub id, or tiny:llama")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None,
                     help="a prompt to answer (repeat for several); without --prompt or --prompts-file, "
                          "prompts are read from stdin")
    src.add_argument("--prompts-file", default=None,
                     help="a file of prompts: one per line, or JSONL rows with 'prompt' (text) or "
                          "'messages' (a chat conversation)")
    p.add_argument("--chat-template", choices=("auto", "yes", "no"), default="auto",
                   help="render prompts with the tokenizer's chat template: auto (default) = as the run "
                        "was trained (its config.yaml chat_template), else yes when the tokenizer has "
                        "one; yes; or no (plain text)")
    p.add_argument("--max-completion-length", type=int, default=256, help="most tokens to generate per answer (256)")
    add_alias_flag(p, "--max-new-tokens", "--max-completion-length")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling (1.0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (results repeat for a seed)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weight dtype (auto: bf16 on a GPU that supports it, else fp32)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code (only for models you trust)")
    a = p.parse_args(argv)
    if a.max_completion_length < 1:
        p.error(f"--max-completion-length must be >= 1, got {a.max_completion_length}")
    if a.temperature < 0:
        p.error(f"--temperature must be >= 0, got {a.temperature}")
    return a


def read_prompts_file(path: str) -> list:
    """Prompts of a file: JSONL rows ({'prompt': str} or {'messages': [...]}) or one plain prompt per line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: prompts file not found (pass --prompts-file FILE, one prompt per line or JSONL)")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; re-encode it as UTF-8") from None
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        value = row.get("messages", row.get("prompt"))
        ok_messages = isinstance(value, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value)
        if not (ok_messages or (isinstance(value, str) and value.strip())):
            raise ConfigError(f"{path}:{lineno}: a JSONL row needs 'prompt' (a non-empty string) or "
                              f"'messages' (a list of {{\"role\", \"content\"}})")
        prompts.append(value)
    if not prompts:
        raise ConfigError(f"{path}: no prompts (the file is empty)")
    return prompts


def interactive(model, tok, a, chat: bool) -> None:
    """A conversation on the terminal (history kept with the chat template), or one prompt per line."""
    tty = sys.stdin.isatty()
    history: list[dict] = []
    if tty:
        print("chat with the model; /reset forgets the conversation, /exit (or Ctrl-D) quits", file=sys.stderr)
    while True:
        try:
            line = input("you> " if tty else "")
        except (EOFError, KeyboardInterrupt):
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = []
            continue
        if not line.strip():
            continue
        if chat and tty:
            history.append({"role": "user", "content": line})
            prompt = history
        else:
            prompt = line
        reply = complete(model, tok, [encode(tok, prompt, chat)], a.max_completion_length, a.temperature, a.top_p,
                         a.seed, name=a.model)[0]
        if chat and tty:
            history.append({"role": "assistant", "content": reply})
        print(f"model> {reply}" if tty else reply, flush=True)


def main(argv=None) -> None:
    a = parse_args(argv)
    try:
        prompts = a.prompt or (read_prompts_file(a.prompts_file) if a.prompts_file else None)
        if a.prompt and not all(p.strip() for p in a.prompt):
            raise ConfigError("--prompt: empty prompt; give the text to answer")
        model, tok = load_for_inference(a.model, a.dtype, a.trust_remote_code)
        prompt_room(model, a.max_completion_length, a.model)  # refused here, in one line, when no prompt fits
        has_template = bool(getattr(tok, "chat_template", None))
        if a.chat_template == "yes" and not has_template:
            raise ConfigError(f"--chat-template yes: {a.model}'s tokenizer has no chat template; "
                              f"use --chat-template no")
        chat = chat_setting(a.model, a.chat_template, default=has_template) and has_template
        if prompts is not None and any(isinstance(p, list) for p in prompts) and not has_template:
            raise ConfigError(f"{a.prompts_file}: 'messages' rows need a tokenizer with a chat template; "
                              f"{a.model}'s has none (use 'prompt' rows)")
        prompt_ids = [encode(tok, p, chat) for p in prompts] if prompts is not None else None
    except (ConfigError, OSError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if prompts is None:
        interactive(model, tok, a, chat)
        return
    replies = complete(model, tok, prompt_ids, a.max_completion_length, a.temperature, a.top_p, a.seed, name=a.model)
    for prompt, reply in zip(prompts, replies):
        shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        print(f">>> {shown}\n{reply}\n", flush=True)


if __name__ == "__main__":
    run_as_program(main)
