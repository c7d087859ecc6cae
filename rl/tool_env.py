"""Multi-turn tool use: an environment whose policy turn may call a tool, and the episode runner that
turns such episodes into rollouts GRPO trains on.

An episode (one row; B rows are run as one batch):

    prompt            "123*45="
    policy turn 1     "<tool>calculator: 123*45</tool>"       sampled; loss_mask 1; the sampler's log-probs
    tool message      "<result>5535</result>"                 appended by the environment; loss_mask 0
    policy turn 2     "5535</s>"                              sampled; loss_mask 1
    reward            scored at the end, on the last policy turn only (the text after the last tool
                      message): the answer counts only when the policy states it itself

The call format is rl.tools' `<tool>NAME: INPUT</tool>`; the sampler (rl.generation.generate) stops at
the close tag. A turn without a call (EOS, or the token budget) ends the episode, as does the
`max_turns`-th policy turn (a call there is not run: nothing could read its result). The token budget
`max_new_tokens` covers the whole episode, tool messages included, so shapes stay those of a one-turn
rollout of that length.

Tool messages are rendered by `tool_message_text`: `<result>RESULT</result>` in plain format, or with
`chat_format` the tokenizer's own chat template for a `tool` message (the text it puts between the
assistant's turn and the next assistant header: `\\n<|tool|>\\nRESULT\\n<|assistant|>\\n` for rl/tiny.py's
template), so real instruct models see the role they were trained with.

What is masked: tool-message tokens are attended by every later token (attention_mask 1) but are no
actions of the policy: `EpisodeRollout.to_batch` sets their labels to -100, and every GRPO term
(surrogate, k3 KL to the reference, old log-probs, token counts of the aggregation) reads only
positions with labels != -100 (rl.losses.token_logprobs' mask), so they are out of the loss and the KL
exactly as if they were prompt tokens. tests/test_tools.py checks it on the loss function itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from rl.data import render_chat
from rl.environments import MathProblemEnv, check_sandbox, load_math_problems, problem_split
from rl.generation import Rollout, generate, left_pad
from rl.losses import IGNORE_INDEX
from rl.tools import TOOL_CLOSE, TOOLS, parse_tool_call, python_tool, run_tool

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


# ------------------------------------------------------------------------------------ the rollout

@dataclass
class EpisodeRollout(Rollout):
    """A `Rollout` whose completion is a whole episode: policy turns and tool messages, right-padded.

    `mask` (B, N) is 1 on every episode token (all are attended), `loss_mask` (B, N) is 1 only on the
    policy's own tokens; `logprobs` are the sampler's on those and 0 on tool tokens."""

    loss_mask: torch.Tensor | None = None  # (B, N) long
    tool_calls: list[int] = field(default_factory=list)  # calls run per row
    turns: list[int] = field(default_factory=list)  # policy turns per row

    def to_batch(self) -> dict[str, torch.Tensor]:
        """As `Rollout.to_batch`, with labels -100 on tool tokens: out of the loss, the KL and the
        token counts, still in the input (attended)."""
        batch = super().to_batch()
        P = self.prompt_ids.shape[1]
        batch["labels"][:, P:] = batch["labels"][:, P:].masked_fill(self.loss_mask == 0, IGNORE_INDEX)
        return batch


def tool_message_text(tokenizer, result: str, chat_format: bool = False) -> str:
    """The text appended after a tool call: `<result>RESULT</result>`, or with chat_format the chat
    template's rendering of a `tool` message followed by the next assistant header (taken as the
    difference between two renderings, so any template that knows the `tool` role works)."""
    if not chat_format:
        return f"{RESULT_OPEN}{result}{RESULT_CLOSE}"
    marker = "\x00CALL\x00"  # stands for the assistant's turn; everything after it is the tool part
    before = render_chat(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}])
    full = render_chat(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker},
                                   {"role": "tool", "content": result}], add_generation_prompt=True)
    if not full.startswith(before[:before.index(marker) + len(marker)]):
        raise ValueError("the chat template renders an assistant turn differently when a tool message follows; "
                         "set env_config.chat_format=false (plain <result>...</result> messages)")
    return full[before.index(marker) + len(marker):]


@torch.no_grad()
def run_episodes(model, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, *,
                 env, num_samples: int = 1, generate_fn: Callable = generate) -> EpisodeRollout:
    """Run B = len(prompts) x num_samples episodes in lockstep, one `generate` call per turn over the
    rows still going (exactly max_turns calls, for ZeRO-3's collectives); returns their EpisodeRollout
    (rows prompt-major, as `generate`'s).

    Each turn samples at most the row's remaining budget, stopping at `</tool>` or EOS; a row's turn
    log-probs are those `generate` returned. Turn t uses base seed `seed + t * 1_000_003` (row j of the
    call: + j), so a seeded run repeats exactly. `env` gives max_turns, tools and tool_message (a
    ToolMathEnv); `generate_fn` (generate's signature) is for tests: a scripted policy."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())
    rows = [list(map(int, p)) for p in prompts for _ in range(num_samples)]
    B = len(rows)
    toks: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    lmask: list[list[int]] = [[] for _ in range(B)]
    reasons, calls, turns = ["length"] * B, [0] * B, [0] * B
    active = list(range(B))
    pad_id, device = None, None
    for turn in range(env.max_turns):
        active = [i for i in active if len(toks[i]) < max_new_tokens]
        # every turn calls the sampler, also with no row left (one throwaway token of row 0): under
        # ZeRO-3 each call gathers the parameters collectively, so all processes must make as many
        contexts = [rows[i] + toks[i] for i in active] or [rows[0]]
        budget = max((max_new_tokens - len(toks[i]) for i in active), default=1)
        out = generate_fn(model, tokenizer, contexts, max_new_tokens=budget, temperature=temperature, top_k=top_k,
                          top_p=top_p, stop_strings=[TOOL_CLOSE], seed=seed + turn * 1_000_003)
        pad_id, device = out.pad_token_id, out.prompt_ids.device
        still = []
        for j, i in enumerate(active):
            keep = out.mask[j].bool()
            room = max_new_tokens - len(toks[i])
            new, new_lp = out.tokens[j][keep].tolist()[:room], out.logprobs[j][keep].tolist()[:room]
            toks[i] += new
            lps[i] += new_lp
            lmask[i] += [1] * len(new)
            turns[i] += 1
            truncated = len(new) < int(keep.sum())
            call = parse_tool_call(tokenizer.decode(new, skip_special_tokens=True))
            if truncated or call is None or out.finish_reasons[j] != "stop":
                reasons[i] = "length" if truncated or out.finish_reasons[j] == "length" else "stop"
                continue
            reasons[i] = "stop"
            if turn + 1 == env.max_turns:
                continue  # the last allowed turn: its call is not run
            calls[i] += 1
            result = tokenizer(env.tool_message(run_tool(call, env.tools)), add_special_tokens=False)["input_ids"]
            result = result[:max_new_tokens - len(toks[i])]
            toks[i] += result
            lps[i] += [0.0] * len(result)
            lmask[i] += [0] * len(result)
            if len(toks[i]) < max_new_tokens:
                still.append(i)
            else:
                reasons[i] = "length"
        active = still
    return _pack(rows, toks, lps, lmask, reasons, calls, turns, pad_id, device)


def _pack(rows, toks, lps, lmask, reasons, calls, turns, pad_id: int, device) -> EpisodeRollout:
    """Lists of per-row episode tokens -> right-padded (B, N) tensors and the left-padded prompts."""
    B, N = len(rows), max(1, max(len(t) for t in toks))
    tokens = torch.full((B, N), pad_id, dtype=torch.long)
    logprobs = torch.zeros(B, N, dtype=torch.float32)
    mask = torch.zeros(B, N, dtype=torch.long)
    loss_mask = torch.zeros(B, N, dtype=torch.long)
    for i in range(B):
        n = len(toks[i])
        tokens[i, :n] = torch.tensor(toks[i], dtype=torch.long)
        logprobs[i, :n] = torch.tensor(lps[i], dtype=torch.float32)
        mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(lmask[i], dtype=torch.long)
    prompt_ids, prompt_mask = left_pad(rows, pad_id, device)
    return EpisodeRollout(tokens=tokens.to(device), logprobs=logprobs.to(device), mask=mask.to(device),
                          prompts=rows, prompt_ids=prompt_ids, prompt_mask=prompt_mask, pad_token_id=pad_id,
                          finish_reasons=reasons, loss_mask=loss_mask.to(device), tool_calls=calls, turns=turns)


# ------------------------------------------------------------------------------------ the environment

def final_turn(completion: str, resume: str = RESULT_CLOSE) -> str:
    """The policy's last turn of a decoded episode: what follows the last tool message, i.e. the first
    `resume` (the text a tool message ends with: `</result>`, or the chat template's assistant header)
    after the last `</tool>`; the whole completion when it has no call; "" when the last call got no
    result (it was made on the max_turns-th turn, or the budget ran out)."""
    if TOOL_CLOSE not in completion:
        return completion
    tail = completion.rsplit(TOOL_CLOSE, 1)[-1]
    return tail.split(resume, 1)[1] if resume in tail else ""


class ToolMathEnv(MathProblemEnv):
    """Arithmetic (default: 3-digit x 2-digit products, "123*45=") that the policy may solve with tools.

    Components (the math environment's, scored on the last policy turn only): `correctness` (weight
    1.0), `formatting` (weight 0 by default: the last turn is exactly one number; a bonus there would
    favour a direct guess over an episode the budget cut short) and `tool_use` (1.0 when the episode
    called a tool; weight `tool_use_weight`, default 0: a metric, rewards/tool_use/mean, the tool-call
    rate, not a reward, so the policy calls tools only where that pays through correctness)."""

    multi_turn = True

    def __init__(self, tokenizer, problems: list[dict], *, tools: Sequence[str], max_turns: int,
                 chat_format: bool, tool_use_weight: float, sandbox: str, python_timeout: float, **kwargs):
        unknown = [t for t in tools if t not in TOOLS]
        if unknown or not tools:
            raise ValueError(f"unknown tools {unknown or tools!r}; choose from {', '.join(TOOLS)}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if "python" in tools:
            check_sandbox(sandbox)  # refuse to start where generated code would run without a private root
        self.tools = {t: TOOLS[t] for t in tools}
        if "python" in tools:
            self.tools["python"] = lambda code: python_tool(code, timeout=python_timeout,
                                                            require_private_root=sandbox == "isolated")
        self.max_turns, self.chat_format = int(max_turns), bool(chat_format)
        self.tool_use_weight = float(tool_use_weight)
        super().__init__(tokenizer, problems, **kwargs)

    def tool_message(self, result: str) -> str:
        return tool_message_text(self.tokenizer, result, self.chat_format)

    @property
    def resume_text(self) -> str:
        """What every tool message ends with (after the result): where the policy's next turn starts."""
        return self.tool_message("\x01").split("\x01", 1)[1]

    def _score_batch(self, prompts, gens, metas):
        total, metrics = super()._score_batch(prompts, [final_turn(g, self.resume_text) for g in gens], metas)
        used = [1.0 if parse_tool_call(g) is not None else 0.0 for g in gens]
        total = [t + self.tool_use_weight * u for t, u in zip(total, used)]
        metrics["reward_tool_use"], metrics["reward_total"] = used, list(total)
        return total, metrics

    def tool_call_text(self, problem: str) -> str:
        return f"<tool>calculator: {problem}</tool>"

    def sft_records(self, n: int | None = None, seed: int | None = None, tool_fraction: float = 0.0) -> list[dict]:
        """{"prompt", "completion"} SFT pairs; a seeded `tool_fraction` of the problems are solved with
        the calculator, as two records whose completions are exactly the policy's own turns:
        ("123*45=" -> "<tool>calculator: 123*45</tool>") and ("123*45=<tool>...</tool><result>5535</result>"
        -> "5535"), so SFT's completion-only loss never trains on tool output (as GRPO does not)."""
        if not 0.0 <= tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
        rng = random.Random(0 if seed is None else seed + 11)
        out = []
        for r in super().sft_records(n, seed):
            problem = r["prompt"][:-1] if r["prompt"].endswith("=") else r["prompt"]
            if rng.random() < tool_fraction:
                call = self.tool_call_text(problem)
                result = self.tool_message(run_tool(parse_tool_call(call), self.tools))
                out += [{"prompt": r["prompt"], "completion": call},
                        {"prompt": r["prompt"] + call + result, "completion": r["completion"]}]
            else:
                out.append(r)
        return out


def generate_product_problem(rng: random.Random, digits: Sequence[int] = (3, 2),
                             answer_digits: int | None = None) -> tuple[str, str]:
    """("a*b", str(a*b)) with a of digits[0] digits and b of digits[1] (leading digit nonzero); with
    `answer_digits`, only products of that many digits (drawn again until one is)."""
    while True:
        a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1) for d in digits)
        if answer_digits is None or len(str(a * b)) == answer_digits:
            return f"{a}*{b}", str(a * b)


def create_tool_math_env(tokenizer, problems_path: str | None = None, num_problems: int = 1000,
                         digits: Sequence[int] = (3, 2), answer_digits: int | None = None, seed: int = 0,
                         split: str = "train",
                         holdout_fraction: float = 0.2, tools: Sequence[str] = ("calculator",), max_turns: int = 2,
                         chat_format: bool = False, tool_use_weight: float = 0.0, correctness_weight: float = 1.0,
                         formatting_weight: float = 0.0, sandbox: str = "isolated", python_timeout: float = 5.0,
                         max_length: int = 128, max_examples: int | None = None) -> ToolMathEnv:
    """`env_type: tool_math`: products of a `digits[0]`-digit and a `digits[1]`-digit number (seeded;
    `split` train/test are disjoint by problem text, as the math environment's) or `problems_path`
    ({"problem","answer"} rows), prompt "a*b=", tools from rl.tools, up to `max_turns` policy turns.
    `answer_digits` keeps only products of that length: every copy the policy makes (problem into the
    call, result into the answer) is then at a fixed distance, which a tiny model learns far sooner."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    if len(digits) != 2 or not all(isinstance(d, int) and 1 <= d <= 9 for d in digits):
        raise ValueError(f"digits must be two digit counts from 1 to 9, e.g. [3, 2], got {digits!r}")
    if answer_digits is not None and not sum(digits) - 1 <= answer_digits <= sum(digits):
        raise ValueError(f"answer_digits must be {sum(digits) - 1} or {sum(digits)} for digits {list(digits)} "
                         f"(a product has that many digits), got {answer_digits}")
    def draw(rng):
        for _ in range(100_000):
            problem, answer = generate_product_problem(rng, digits, answer_digits)
            if split == "all" or problem_split(problem, holdout_fraction) == split:
                return problem, answer
        raise RuntimeError(f"no {split!r} problem found; check holdout_fraction={holdout_fraction}")

    if problems_path:  # a fixed set: sample_prompts draws from it
        problems, generator = load_math_problems(problems_path, max_examples), None
    else:  # generated: sample_prompts draws fresh problems of the split
        rng = random.Random(seed)
        problems, generator = [dict(zip(("problem", "answer"), draw(rng))) for _ in range(num_problems)], draw
    return ToolMathEnv(tokenizer, problems, tools=list(tools), max_turns=max_turns, chat_format=chat_format,
                       tool_use_weight=tool_use_weight, sandbox=sandbox, python_timeout=python_timeout,
                       answer_format="plain", prompt_template="{problem}=", correctness_weight=correctness_weight,
                       formatting_weight=formatting_weight, generator=generator, max_length=max_length, seed=seed)
