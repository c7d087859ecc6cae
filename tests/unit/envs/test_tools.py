"""Multi-turn tool use (rl.envs.tools, rl.envs.tool_math, rl.rollout.episodes): the calculator and the call parser against hand-computed
values, an episode of a scripted policy (no sampling from a random model), the exclusion of tool-result
tokens from the GRPO loss and KL, the environment's registry entry and errors, and one slow "it learns"
run: SFT on a teacher that calls the calculator 30% of the time, then GRPO, on held-out problems."""

from __future__ import annotations

import math

import pytest
import torch

from rl.algos.policy_losses import grpo_loss
from rl.config.fields import build
from rl.engine.generation import Rollout
from rl.engine.losses import token_logprobs
from rl.engine.packing import left_pad
from rl.envs.registry import ENV_TYPES, make_env
from rl.envs.tool_math import create_tool_math_env
from rl.envs.tools import (
    MAX_RESULT_CHARS,
    ToolCall,
    ToolError,
    calculator,
    final_turn,
    parse_tool_call,
    run_tool,
    tool_message_text,
)
from rl.errors import ConfigError
from rl.models.tiny import build_tokenizer
from rl.rollout.episodes import EpisodeRollout, run_episodes
from rl.trainers.grpo import GRPOTrainer, grpo_loss_fn
from rl.trainers.grpo_batch import select_rollout
from rl.trainers.grpo_config import GRPOConfig
from tests.conftest import LEARN_SEED, learned

TOK = build_tokenizer()


# ------------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expr, want", [
    ("123*45", "5535"), ("7/2", "3.5"), ("2**10", "1024"), ("-3+4*(2-5)", "-15"), ("0.1+0.2", "0.3"),
    ("1/3", "0.3333333333"), ("1/3*3", "1"), ("17//5", "3"), ("17%5", "2"), ("-17//5", "-4"), ("2**-2", "0.25"),
    ("+5", "5"), (" 999*99 ", "98901"), ("2**64", "18446744073709551616"), ("10**60", "1" + "0" * 60),
])
def test_calculator_hand_computed(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr, why", [
    ("x+1", "Name is not allowed"), ("().__class__", "Attribute is not allowed"), ("abs(-1)", "Call is not allowed"),
    ("__import__('os')", "Call is not allowed"), ("'a'*3", "only numbers"), ("True+1", "only numbers"),
    ("1<2", "Compare is not allowed"), ("[1][0]", "not allowed"), ("lambda: 1", "Lambda is not allowed"),
    ("9**999999", "exponent 999999 is too large"), ("2**65", "too large"), ("(10**30)**3", "too large"),
    ("10**61", "out of range"), ("1e400", "out of range"), ("2**0.5", "integer exponents"), ("1/0", "division by zero"),
    ("5%0", "division by zero"), ("0**-1", "division by zero"), ("", "empty"), ("1+", "cannot parse"),
    ("1" * 201, "longer than 200"), ("1;2", "cannot parse"), ("1j", "only numbers"),
])
def test_calculator_rejects(expr, why):
    with pytest.raises(ToolError, match=why):
        calculator(expr)


def test_parse_tool_call():
    assert parse_tool_call("<tool>calculator: 123*45</tool>") == ToolCall("calculator", "123*45")
    # the last complete call of the turn; one leading space dropped; a token may carry text past the tag
    assert parse_tool_call("hm <tool>a:1</tool> then <tool> python :print(1)\n</tool>\n") == \
        ToolCall("python", "print(1)\n")
    assert parse_tool_call("<tool>calculator:  2</tool>") == ToolCall("calculator", " 2")
    for not_a_call in ("5535", "<tool>123*45</tool>", "<tool>calculator: 1+2", "<tool>9x: 1</tool>", "", None):
        assert parse_tool_call(not_a_call) is None


def test_run_tool_errors_are_results():
    tools = {"calculator": calculator}
    assert run_tool(ToolCall("calculator", "6*7"), tools) == "42"
    assert run_tool(ToolCall("calculator", "x"), tools).startswith("error: Name is not allowed")
    assert run_tool(ToolCall("shell", "ls"), tools) == "error: unknown tool 'shell'; tools: calculator"
    assert run_tool(ToolCall("calculator", "1" * 3000), tools) == "error: input longer than 2000 characters"
    assert len(run_tool(ToolCall("echo", ""), {"echo": lambda s: "9" * 1000})) == MAX_RESULT_CHARS


def test_python_tool_runs_only_in_the_sandbox():
    from rl.envs import isolation
    from rl.envs.tools import python_tool

    if isolation.isolation_level() != "private-root":
        with pytest.raises(ToolError, match="private root"):
            python_tool("print(1)")
        return
    assert python_tool("import os\nprint(6*7, os.getcwd() != %r)" % str(__import__("os").getcwd())) == "42 True"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        python_tool("1/0")


# ------------------------------------------------------------------------------- episodes

def scripted_generate(calls: dict[str, str] | None = None, lp: float = -0.5):
    """A deterministic policy in `generate`'s signature: its first turn writes `calls[prompt]` (default
    the correct calculator call, "" for a direct wrong answer "1"), after a tool message it copies the
    result and stops. Every sampled token gets log-prob `lp` (so the test can tell them from tool tokens)."""
    calls = calls or {}

    def gen(model, tok, prompts, max_new_tokens, stop_strings=None, seed=None, **kw):
        assert stop_strings == ["</tool>"]
        outs, reasons = [], []
        for p in prompts:
            text = tok.decode(p, skip_special_tokens=True)
            problem = text.split("=")[0]
            if "</result>" in text:
                out = tok(text.rsplit("<result>", 1)[1].split("</result>")[0], add_special_tokens=False)["input_ids"]
                out += [tok.eos_token_id]
            else:
                call = calls.get(problem, f"<tool>calculator: {problem}</tool>")
                out = tok(call or "1", add_special_tokens=False)["input_ids"] + ([] if call else [tok.eos_token_id])
            reasons.append("stop" if len(out) <= max_new_tokens else "length")
            outs.append(out[:max_new_tokens])
        N = max(len(o) for o in outs)
        t, m = torch.zeros(len(outs), N, dtype=torch.long), torch.zeros(len(outs), N, dtype=torch.long)
        for i, o in enumerate(outs):
            t[i, :len(o)], m[i, :len(o)] = torch.tensor(o), 1
        ids, pmask = left_pad(prompts, tok.pad_token_id)
        return Rollout(tokens=t, logprobs=lp * m.float(), mask=m, prompts=prompts, prompt_ids=ids, prompt_mask=pmask,
                       pad_token_id=tok.pad_token_id, finish_reasons=reasons)

    return gen


def _env(**kw):
    return create_tool_math_env(TOK, problems_path=None, num_problems=4, **kw)


def _episode(env, problems, max_new_tokens=64, **kw):
    ids = [TOK(f"{p}=")["input_ids"] for p in problems]
    return run_episodes(None, TOK, ids, max_new_tokens=max_new_tokens, env=env, seed=0,
                        generate_fn=scripted_generate(**kw))


def test_episode_with_a_scripted_policy():
    env = _env()
    # 123*45 calls the tool; 99*99 answers "1" directly; 12*12 writes a call the calculator refuses
    ro = _episode(env, ["123*45", "99*99", "12*12"], calls={"99*99": "", "12*12": "<tool>calculator: 12x12</tool>"},
                  max_new_tokens=160)
    texts = TOK.batch_decode(ro.completions(), skip_special_tokens=True)
    assert texts == ["<tool>calculator: 123*45</tool><result>5535</result>5535",
                     "1",
                     "<tool>calculator: 12x12</tool><result>error: cannot parse '12x12' as arithmetic</result>"
                     "error: cannot parse '12x12' as arithmetic"]
    assert ro.tool_calls == [1, 0, 1] and ro.turns == [2, 1, 2] and ro.finish_reasons == ["stop"] * 3
    # row 0: 31 call tokens (sampled), 21 tool tokens, 4 answer digits + EOS (sampled)
    n_call, n_tool = len("<tool>calculator: 123*45</tool>"), len("<result>5535</result>")
    want = [1] * n_call + [0] * n_tool + [1] * 5
    assert ro.loss_mask[0, :len(want)].tolist() == want and int(ro.mask[0].sum()) == len(want)
    assert ro.logprobs[0, :len(want)].tolist() == [-0.5 if w else 0.0 for w in want]
    assert ro.loss_mask[1].tolist()[:3] == [1, 1, 0] and ro.mask[1].tolist()[:3] == [1, 1, 0]  # "1", EOS
    rewards, m = env.score(["123*45=", "99*99=", "12*12="], texts, [{"answer": "5535"}, {"answer": "9801"},
                                                                    {"answer": "144"}])
    assert m["reward_correctness"] == [1.0, 0.0, 0.0] and m["reward_tool_use"] == [1.0, 0.0, 1.0]
    assert rewards == pytest.approx([1.0, 0.0, 0.0]) and m["reward_formatting"] == [1.0, 1.0, 0.0]  # weight 0
    # the training batch: labels are the episode's tokens where loss_mask is 1, -100 elsewhere
    batch = ro.to_batch()
    P = ro.prompt_ids.shape[1]
    assert batch["attention_mask"][0, P:P + len(want)].tolist() == [1] * len(want)
    assert [x != -100 for x in batch["labels"][0, P:P + len(want)].tolist()] == [bool(w) for w in want]
    assert batch["old_logprobs"][0, P - 1:P - 1 + len(want)].tolist() == ro.logprobs[0, :len(want)].tolist()


def test_episode_budget_and_max_turns():
    env = _env(max_turns=1)  # the only turn's call is not run: no result, empty final turn, reward 0
    ro = _episode(env, ["123*45"])
    assert ro.tool_calls == [0] and ro.turns == [1] and ro.loss_mask.tolist() == [[1] * 31]
    text = TOK.decode(ro.completions()[0], skip_special_tokens=True)
    assert env.score(["123*45="], [text], [{"answer": "5535"}])[0] == [0.0]
    # a 40-token budget: the 31-token call runs, the tool message is cut at 9 tokens, the episode ends
    ro = _episode(_env(), ["123*45"], max_new_tokens=40)
    assert ro.loss_mask.tolist() == [[1] * 31 + [0] * 9] and ro.finish_reasons == ["length"] and ro.turns == [1]
    # a 20-token budget cuts the call itself: no tool runs
    ro = _episode(_env(), ["123*45"], max_new_tokens=20)
    assert ro.tool_calls == [0] and ro.finish_reasons == ["length"] and ro.loss_mask.tolist() == [[1] * 20]
    # the sampler is called max_turns times even when every row is done after one turn (ZeRO-3 collectives)
    calls, gen = [], scripted_generate(calls={"99*99": ""})
    ro = run_episodes(None, TOK, [TOK("99*99=")["input_ids"]], max_new_tokens=64, env=_env(max_turns=3), seed=0,
                      generate_fn=lambda *a, **k: calls.append(1) or gen(*a, **k))
    assert len(calls) == 3 and ro.turns == [1] and TOK.decode(ro.completions()[0], skip_special_tokens=True) == "1"


def test_final_turn_and_chat_format():
    assert final_turn("<tool>calculator: 1+2</tool><result>3</result>3") == "3"
    assert final_turn("42") == "42" and final_turn("<tool>calculator: 1+2</tool>") == ""
    # the tiny template's tool message: the text between the assistant's turn and the next assistant header
    text = tool_message_text(TOK, "5535", chat_format=True)
    assert text == "\n<|tool|>\n5535\n<|assistant|>\n"
    env = _env(chat_format=True)
    assert env.resume_text == "\n<|assistant|>\n"
    done = "<tool>calculator: 123*45</tool>" + text + "5535"
    assert env.score(["123*45="], [done], [{"answer": "5535"}])[1]["reward_correctness"] == [1.0]


def test_sft_records_split_tool_examples_into_policy_turns():
    env = _env()
    recs = env.sft_records(200, seed=0, tool_fraction=0.3)
    tool = [r for r in recs if r["completion"].startswith("<tool>")]
    direct = [r for r in recs if not r["completion"].startswith("<tool>") and "<result>" not in r["prompt"]]
    assert len(tool) + len(direct) == 200 and 40 <= len(tool) <= 80  # ~30% of 200, seeded
    r0 = recs[recs.index(tool[0]) + 1]  # the answer record follows its call record
    problem = tool[0]["prompt"][:-1]
    a, b = map(int, problem.split("*"))
    assert tool[0]["completion"] == f"<tool>calculator: {problem}</tool>"
    assert r0 == {"prompt": f"{problem}=<tool>calculator: {problem}</tool><result>{a * b}</result>",
                  "completion": str(a * b)}
    assert all(r["completion"] == str(math.prod(map(int, r["prompt"][:-1].split("*")))) for r in direct)
    assert env.sft_records(50, seed=0, tool_fraction=0.0) == env.sft_records(50, seed=0)
    with pytest.raises(ValueError, match="tool_fraction"):
        env.sft_records(5, tool_fraction=1.5)


def test_env_registry_and_errors():
    assert "tool_math" in ENV_TYPES
    env = make_env("tool_math", TOK, {"digits": [2, 1], "num_problems": 20, "split": "test"})
    assert env.multi_turn and env.max_turns == 2 and list(env.tools) == ["calculator"]
    assert all(len(m["problem"]) == 4 and int(m["answer"]) == eval(m["problem"]) for m in env.metadata)  # noqa: S307
    train = {m["problem"] for m in make_env("tool_math", TOK, {"num_problems": 300}).metadata}
    test = {m["problem"] for m in make_env("tool_math", TOK, {"num_problems": 300, "split": "test"}).metadata}
    assert train and test and not train & test
    for bad, why in (({"tools": ["shell"]}, "unknown tools"), ({"max_turns": 0}, "max_turns"),
                     ({"digits": [3]}, "digits"), ({"split": "dev"}, "split"), ({"turns": 2}, "bad config")):
        with pytest.raises(ValueError, match=why):
            make_env("tool_math", TOK, bad)


def test_grpo_trainer_reports_a_bad_tool_env_in_one_line(tiny_llama):
    cfg = build(GRPOConfig, {"model_name": tiny_llama, "env_type": "tool_math", "env_config": {"tools": ["shell"]},
                             "max_steps": 1, "per_device_train_batch_size": 8, "num_generations": 4})
    with pytest.raises(ConfigError, match=r"env_type=tool_math: unknown tools \['shell'\]"):
        GRPOTrainer(cfg)


# ------------------------------------------------------------------------------- loss mask

def test_tool_tokens_are_out_of_the_loss_and_the_kl():
    """GRPO's loss on an episode batch does not change when anything at the tool-result positions
    changes (the policy's logits there, old and reference log-probs), its gradient there is exactly 0,
    and it equals grpo_loss computed with the loss mask by hand."""
    env = _env()
    ro = _episode(env, ["123*45", "99*99"], calls={"99*99": ""})
    batch = ro.to_batch()
    ids, labels = batch["input_ids"], batch["labels"]
    B, T = ids.shape
    P = ro.prompt_ids.shape[1]
    tool = torch.zeros(B, T - 1, dtype=torch.bool)  # position t-1 predicts token t
    tool[:, P - 1:] = (ro.mask == 1) & (ro.loss_mask == 0)
    assert int(tool.sum()) == 21
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, 300, generator=g, requires_grad=True)
    old = batch["old_logprobs"] + 0.1 * torch.randn(B, T - 1, generator=g)
    ref = batch["old_logprobs"] + 0.2 * torch.randn(B, T - 1, generator=g)
    kw = dict(advantages=torch.tensor([1.0, -1.0]), beta=0.04, epsilon_low=0.2, epsilon_high=0.28,
              loss_aggregation="token_mean", max_completion_length=64, num_items=None)

    loss, _ = grpo_loss_fn(logits, labels, old_logprobs=old, ref_logprobs=ref, **kw)
    loss.backward()
    assert logits.grad[:, :-1][tool].abs().max() == 0  # no gradient through tool-result predictions
    assert logits.grad[:, :-1][~tool & (labels[:, 1:] != -100)].abs().sum() > 0

    # change everything at the tool positions: logits, old and reference log-probs
    noise = torch.zeros_like(logits)
    noise[:, :-1][tool] = 5.0 * torch.randn(int(tool.sum()), 300, generator=g)
    old2, ref2 = old.masked_fill(tool, -7.0), ref.masked_fill(tool, 3.0)
    loss2, _ = grpo_loss_fn(logits.detach() + noise, labels, old_logprobs=old2, ref_logprobs=ref2, **kw)
    assert float(loss2) == float(loss.detach())

    # the same number from the loss mask itself: token log-probs of the full sequence, mask = loss_mask
    all_labels = ids.clone()
    all_labels[:, :P] = -100
    all_labels[:, P:] = all_labels[:, P:].masked_fill(ro.mask == 0, -100)
    logp, _ = token_logprobs(logits.detach(), all_labels)
    mask = torch.zeros(B, T - 1)
    mask[:, P - 1:] = ro.loss_mask.float()
    adv = kw.pop("advantages")
    by_hand, _ = grpo_loss(logp, old, adv, mask, ref_logp=ref, **kw)
    torch.testing.assert_close(by_hand, loss.detach())


def test_dynamic_sampling_selection_keeps_the_loss_mask():
    env = _env()
    a = _episode(env, ["123*45", "99*99"], calls={"99*99": ""})
    b = _episode(env, ["12*34"])
    picked = select_rollout([a, b], [2, 0])  # b's row, then a's first
    assert isinstance(picked, EpisodeRollout) and picked.tool_calls == [1, 1]
    for j, (ro, i) in enumerate([(b, 0), (a, 0)]):
        n = int(ro.mask[i].sum())
        assert picked.loss_mask[j, :n].tolist() == ro.loss_mask[i, :n].tolist()
        assert picked.tokens[j, :n].tolist() == ro.tokens[i, :n].tolist()


def test_ppo_trains_on_episodes_with_tool_tokens_out_of_the_loss(tiny_llama, tmp_path, monkeypatch):
    """PPO on env_type tool_math: the episodes come from run_episodes (a scripted policy that always
    calls the calculator and copies the result), the advantages' mask is the loss mask (0 on the tool
    message, 1 on both policy turns), and the episode's final answer is scored (the score's place after
    the gap: test_ppo.py's test_score_only_at_last_response_token)."""
    import rl.trainers.ppo
    from rl.trainers.ppo import PPOTrainer
    from rl.trainers.ppo_config import PPOConfig

    monkeypatch.setattr(rl.trainers.ppo, "run_episodes", lambda *a, **k: run_episodes(*a, **k, generate_fn=scripted_generate()))
    seen = {}
    real = rl.trainers.ppo.ppo_advantages

    def spy(cfg, scores, eos_missing, old_logp, ref_logp, old_values, mask, kl_coef):
        out = real(cfg, scores, eos_missing, old_logp, ref_logp, old_values, mask, kl_coef)
        seen.update(mask=mask.clone(), scores=scores.clone())
        return out

    monkeypatch.setattr(rl.trainers.ppo, "ppo_advantages", spy)
    cfg = PPOConfig(model_name=tiny_llama, output_dir=str(tmp_path), env_type="tool_math",
                    env_config={"digits": [2, 2], "answer_digits": 4, "num_problems": 8, "max_turns": 2},
                    max_steps=1, per_device_train_batch_size=4, mini_batch_size=4, num_ppo_epochs=1, max_completion_length=64,
                    max_length=96, beta=0.1, report_to=["none"], dtype="float32", device="cpu")
    t = PPOTrainer(cfg)
    row = t.train()[0]
    mask = seen["mask"]
    # every episode: call (policy) + <result>...</result> (tool, out) + copied answer + EOS (policy)
    call_len = len(TOK("<tool>calculator: 12*34</tool>", add_special_tokens=False)["input_ids"])
    for m in mask.tolist():
        n = len(m) - m[::-1].index(1)  # one past the last policy token
        gap = [j for j in range(n) if m[j] == 0]
        assert gap and gap[0] == call_len and gap == list(range(gap[0], gap[-1] + 1)), m
    assert seen["scores"].tolist() == [1.0] * 4  # the copied results are right
    assert all(v == v for v in row.values() if isinstance(v, float))  # finite metrics, no NaN
    assert row["objective/scores"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------- it learns

def call_probability(model_dir: str, prompts: list[str]) -> float:
    """Mean probability that the policy's first token opens a tool call ("<" of `<tool>`), teacher-forced
    on held-out prompts: a continuous, deterministic measure of the tool-call rate (greedy decoding
    turns it into a 0/1 per prompt that flips on small changes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids, mask = left_pad([TOK(p)["input_ids"] for p in prompts], TOK.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    lt = TOK("<", add_special_tokens=False)["input_ids"][0]
    return float(torch.softmax(logits[:, -1].float(), -1)[:, lt].mean())


@pytest.mark.slow
def test_sft_teacher_then_grpo_raises_the_tool_call_rate(tmp_path):
    """recipes/tiny/tool_pipeline.yaml, shortened: SFT on a teacher that calls the calculator on 30% of
    4-digit products of two 2-digit numbers, then 12 GRPO steps; on held-out problems the probability
    of calling the tool must rise (the robust signal: calling pays through correctness as soon as
    copying mostly works). Greedy accuracy and tool-call rate are reported, not bounded."""
    import json
    import os
    import sys

    from tests.conftest import run_cmd

    run_cmd([sys.executable, "launch/pipeline.py", "--config", "recipes/tiny/tool_pipeline.yaml",
             f"output_dir={tmp_path}", f"seed={LEARN_SEED}", "sft.max_steps=300", "num_sft_examples=9600",
             "grpo.max_steps=12", "grpo.eval_steps=12", "eval_num_prompts=32"],
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    s = json.loads((tmp_path / "summary.json").read_text())
    held_out = [r["prompt"] for r in create_tool_math_env(None, digits=[2, 2], answer_digits=4, split="test",
                                                          num_problems=64, seed=LEARN_SEED).sample_prompts(64, seed=1)]
    before, after = (call_probability(str(tmp_path / d), held_out) for d in ("sft", "grpo"))
    learned("tool_greedy_call_rate_gain", s["grpo_tool_call_rate"] - s["sft_tool_call_rate"])
    learned("tool_accuracy_gain", s["improvement"])
    learned("tool_call_probability_before", before)
    # measured 2026-12-01 (seeds 0, 1, 2): OMP/torch threads 1: +0.724, +0.438, +0.636; threads 2: +0.569,
    # +0.471, +0.501 (before: 0.21-0.48). The greedy tool-call rate rose by 0.22-0.63 and the greedy accuracy
    # by -0.06..+0.63 in the same runs, too noisy on 32 problems to bound.
    assert learned("tool_call_probability_gain", after - before) >= 0.3, (before, after, s)


def test_call_parser_equals_its_regex_and_is_linear():
    """`parse_tool_call` gives what the regex `<tool>\\s*NAME\\s*:(.*?)</tool>` (last match) gives, on random
    turns built from the syntax's pieces, in one pass: 2 MB of unclosed `<tool>` tags or of an unclosed
    call parse in one linear scan (the lazy regex rescanned the rest of the turn from every tag: 66 KB
    took 4 s, 128 KB 17 s)."""
    import random
    import re

    pattern = re.compile(r"<tool>\s*([A-Za-z_]\w*)\s*:(.*?)</tool>", re.DOTALL)
    rng = random.Random(0)
    atoms = ["<tool>", "</tool>", "calculator", ":", " ", "1+2", "x", "\n", "<tool>calculator: 3*4</tool>", "<", "_a1"]
    for _ in range(5000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        calls = pattern.findall(text)
        want = None if not calls else (calls[-1][0], calls[-1][1][1:] if calls[-1][1].startswith(" ") else calls[-1][1])
        got = parse_tool_call(text)
        assert (None if got is None else (got.name, got.input)) == want, text
    assert parse_tool_call("<tool>" * 350_000) is None
    assert parse_tool_call("<tool>calculator: " * 110_000) is None
    assert parse_tool_call("<tool>" * 100_000 + "<tool>calculator: 1+1</tool>") == ToolCall("calculator", "1+1")
