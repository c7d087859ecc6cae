"""Held-out accuracy of a model on prompt/answer data, scored by a verifiable reward.

    python launch/eval.py --model tiny:llama --data heldout.jsonl           # before training
    python launch/eval.py --model runs/grpo  --data heldout.jsonl --out runs/grpo/eval.json   # after
    python launch/eval.py --model runs/sft --model runs/grpo --data heldout.jsonl   # both, one line each

Each row of --data needs a prompt (column 'prompt', or 'problem' as in the math environment's files)
and an answer ('answer': a number or a string, e.g. LaTeX). The model answers every prompt (greedy by
default) and --reward scores each completion against its row; accuracy is the share of rows scoring at
least --threshold. The default reward, `correctness`, is the math checker the trainers use (exact
numbers, then math-verify for LaTeX). Prompts are tokenised as in training: BOS once, then the prompt;
with the chat template when the run was trained with it (its config.yaml), or with --chat-template yes.
--data takes what data.path takes: a JSONL/JSON/CSV/Parquet file, a dataset folder or a Hub id.

A run trained on an environment (its config.yaml names `env_type`, e.g. the main job's GRPO stage) is
evaluated as it was trained and measured: --data's problems go through that environment (its prompt
format, e.g. the math environment's `219+2=`, its answer check) with the run's own completion length and
greedy decoding, the held-out evaluation the trainer ran (`rl.rollout.eval.greedy_eval`). So
`python launch/eval.py --model runs/tiny-pipeline/grpo --data data/tiny/math_test.jsonl` reproduces the
main job's GRPO figure. `--format plain` scores the raw prompts with --reward instead.
"""

from __future__ import annotations

import argparse
import json
import os
from numbers import Number
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml

from rl.config.vocabulary import add_alias_flag
from rl.data.records import SUFFIXES, read_records, where
from rl.engine.dist import run_as_program
from rl.envs.registry import make_env
from rl.errors import (
    ConfigError,
    DataError,
)
from rl.models.limits import prompt_room
from rl.rewards.functions import get_reward_fn
from rl.rollout.eval import greedy_eval, unique_eval_set
from rl.scripts.common import fail
from rl.scripts.inference import chat_setting, complete, encode, load_for_inference


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/eval.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, action="append",
                   help="a run's output directory (full model or PEFT adapter), a hub id, or tiny:llama; "
                        "repeat it to compare models (before/after) on the same rows")
    p.add_argument("--data", required=True,
                   help="prompt/answer rows: a .jsonl/.json/.csv/.parquet file, a dataset folder or a Hub id")
    p.add_argument("--name", default=None, help="config (subset) of a dataset folder or Hub id")
    p.add_argument("--split", default="test", help="split of a dataset folder, Hub id or saved DatasetDict "
                                                   "(default test; a single file is its own split)")
    p.add_argument("--prompt-column", default=None,
                   help="column with the prompt (default: 'prompt', else 'problem')")
    p.add_argument("--answer-column", default="answer", help="column with the reference answer (default answer)")
    p.add_argument("--reward", default="correctness",
                   help="verifiable reward: correctness (default), another named reward, or "
                        "module:function with the trainers' signature (prompts, completions, metadata)")
    p.add_argument("--threshold", type=float, default=1.0,
                   help="a row counts as correct when its reward is >= this (default 1.0)")
    p.add_argument("--max-examples", type=int, default=None, help="score only the first N rows")
    p.add_argument("--max-completion-length", type=int, default=64, help="most tokens per answer (default 64)")
    add_alias_flag(p, "--max-new-tokens", "--max-completion-length")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (results repeat for a seed)")
    p.add_argument("--per-device-eval-batch-size", type=int, default=16, help="prompts generated together (default 16)")
    add_alias_flag(p, "--batch-size", "--per-device-eval-batch-size")
    p.add_argument("--chat-template", choices=("auto", "yes", "no"), default="auto",
                   help="render prompts with the chat template: auto (default) = as the run was trained "
                        "(its config.yaml chat_template), else no; yes; no")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weight dtype (auto: bf16 on a GPU that supports it, else fp32)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model's own Python code (only for models you trust)")
    p.add_argument("--format", choices=("auto", "plain"), default="auto",
                   help="auto (default): a run trained on an environment is evaluated through it, as its "
                        "trainer measured held-out accuracy; plain: the raw prompts, scored by --reward")
    p.add_argument("--out", default=None,
                   help="write a JSON {\"runs\": [one per --model: summary and every example (prompt, "
                        "answer, completion, reward)]}")
    a = p.parse_args(argv)
    for key in ("max_completion_length", "per_device_eval_batch_size", "max_examples"):
        value = getattr(a, key)
        if value is not None and value < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    if a.temperature < 0:
        p.error(f"--temperature must be >= 0, got {a.temperature}")
    return a


def load_examples(a) -> list[dict]:
    """Validated {"prompt", "answer", "meta", "_line"} rows of --data (file:line errors)."""
    if not Path(a.data).exists() and Path(a.data).suffix.lower() in SUFFIXES:
        raise DataError(f"--data: data file not found: {a.data}")
    rows = read_records(a.data, name=a.name, split=a.split)
    if not rows:
        raise DataError(f"{a.data}: no examples (the file is empty)")
    present = sorted({k for r in rows[:1000] for k in r if k != "_line"})
    col = a.prompt_column or ("prompt" if "prompt" in present or "problem" not in present else "problem")
    for c in (col, a.answer_column):
        if c not in present:
            raise DataError(f"{a.data}: missing column '{c}' (columns present: {', '.join(present) or 'none'}); "
                            f"pass --prompt-column / --answer-column")
    out = []
    for row in rows[:a.max_examples] if a.max_examples else rows:
        prompt, answer = row.get(col), row.get(a.answer_column)
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{where(a.data, row)}: column '{col}' must be a non-empty string")
        if isinstance(answer, bool) or not isinstance(answer, (str, Number)) or str(answer).strip() == "":
            raise DataError(f"{where(a.data, row)}: column '{a.answer_column}' must be a number or a "
                            f"non-empty string")
        meta = {k: v for k, v in row.items() if k not in (col, "_line")}
        meta["answer"] = answer
        out.append({"prompt": prompt, "answer": answer, "meta": meta, "_line": row["_line"]})
    return out


def score(reward_fn, examples: list[dict], completions: list[str], threshold: float) -> dict:
    """Per-example rewards and the summary: accuracy = share of rewards >= threshold, mean reward."""
    rewards = [float(r) for r in reward_fn([e["prompt"] for e in examples], completions,
                                           [e["meta"] for e in examples])]
    if len(rewards) != len(examples):
        raise ValueError(f"the reward returned {len(rewards)} values for {len(examples)} completions")
    correct = [r >= threshold for r in rewards]
    per_example = [{"line": e["_line"], "prompt": e["prompt"], "answer": e["answer"], "completion": c,
                    "reward": r, "correct": ok}
                   for e, c, r, ok in zip(examples, completions, rewards, correct)]
    return {"accuracy": sum(correct) / len(correct), "correct": sum(correct), "n": len(correct),
            "mean_reward": sum(rewards) / len(rewards), "examples": per_example}


def saved_environment(model_name: str) -> dict | None:
    """The run's config.yaml when it trained on an environment (`env_type`), else None."""
    recipe = Path(model_name) / "config.yaml"
    try:
        saved = yaml.safe_load(recipe.read_text()) if recipe.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError):
        return None
    return saved if isinstance(saved, dict) and saved.get("env_type") else None


def evaluate_in_environment(a, model_name: str, saved: dict) -> dict:
    """The trainer's own held-out measure on --data: the run's environment, prompt length and completion
    length, greedy (`rl.rollout.eval.greedy_eval` over `unique_eval_set`, as GRPO and online DPO evaluate)."""
    try:
        model, tok = load_for_inference(model_name, a.dtype, a.trust_remote_code)
        env_config = {**(saved.get("env_config") or {}), **(saved.get("eval_env_config") or {}), "problems_path": a.data}
        env = make_env(saved["env_type"], tok, env_config)
        prompts, metas = unique_eval_set(env, a.max_examples or int(saved.get("eval_num_prompts") or 10 ** 9))
    except (ConfigError, DataError, OSError, ValueError, TypeError) as e:
        fail(f"--model {model_name}: its environment {saved['env_type']!r} cannot read {a.data} "
             f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); use --format plain")
    max_new = int(saved.get("max_completion_length") or a.max_completion_length)
    budget = int(saved.get("max_length") or 512) - max_new
    chat = chat_setting(model_name, a.chat_template, default=False)
    m = greedy_eval(model, tok, env, prompts, metas, max_new, budget, batch_size=a.per_device_eval_batch_size, chat=chat)
    n = m["eval/num_prompts"]
    return {"model": model_name, "data": a.data, "environment": saved["env_type"], "chat_template": chat,
            "n": n, "correct": round(m["eval/accuracy"] * n), "accuracy": m["eval/accuracy"],
            "mean_reward": m["eval/reward"], "max_new_tokens": max_new}


def evaluate(a, model_name: str, reward_fn, examples: list[dict]) -> dict:
    """One model's summary and per-example results on `examples`."""
    saved = saved_environment(model_name) if a.format == "auto" else None
    if saved is not None:
        return evaluate_in_environment(a, model_name, saved)
    try:
        model, tok = load_for_inference(model_name, a.dtype, a.trust_remote_code)
        prompt_room(model, a.max_completion_length, model_name)  # refused here, in one line, when no prompt fits
        chat = chat_setting(model_name, a.chat_template, default=False)
        if chat and not getattr(tok, "chat_template", None):
            raise ConfigError(f"{model_name}'s tokenizer has no chat template; use --chat-template no")
        prompt_ids = [encode(tok, e["prompt"], chat) for e in examples]
    except (ConfigError, DataError, OSError, ValueError, ImportError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    completions = complete(model, tok, prompt_ids, a.max_completion_length, a.temperature, seed=a.seed,
                           batch_size=a.per_device_eval_batch_size, name=model_name)
    try:
        result = score(reward_fn, examples, completions, a.threshold)
    except Exception as e:  # noqa: BLE001 - the user's reward function failing: one line naming it
        why = str(e).splitlines()[0] if str(e) else ""
        fail(f"--reward {a.reward}: raised {type(e).__name__}{': ' + why if why else ''}", code=1)
    return {"model": model_name, "data": a.data, "reward": a.reward, "threshold": a.threshold,
            "chat_template": chat, **result}


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.out and Path(a.out).is_dir():  # checked now, not after the whole evaluation ran
        fail(f"--out {a.out} is a directory; give a file name such as {Path(a.out) / 'eval.json'}")
    try:
        reward_fn = get_reward_fn(a.reward)
        examples = load_examples(a)  # the data is checked before any model is loaded
    except (ConfigError, DataError, OSError, ValueError, ImportError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        # the loader speaks of recipe keys; here they are this command's options
        for key, option in (("data.split (or data.eval_split)", "--split"), ("data.name", "--name"),
                            ("data.path", "--data")):
            msg = msg.replace(key, option)
        fail(msg)
    runs = []
    for model_name in a.model:  # one at a time: only one model is in memory
        run = evaluate(a, model_name, reward_fn, examples)
        how = f"  (its {run['environment']} environment, as trained)" if "environment" in run else ""
        print(f"accuracy {run['accuracy']:.3f} ({run['correct']}/{run['n']})  mean reward "
              f"{run['mean_reward']:.3f}  model {model_name}  data {a.data}{how}", flush=True)
        runs.append(run)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"runs": runs}, indent=1, default=str))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    run_as_program(main)
