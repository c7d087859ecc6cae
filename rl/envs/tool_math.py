r"""Multi-turn tool use (`env_type: tool_math`): arithmetic (default 3-digit x 2-digit products, "123*45=")
that the policy may solve by calling a tool in the middle of its turn. rl.rollout.episodes runs the
episodes (`run_episodes`); this module is the environment they ask for tools, tool messages and rewards.

An episode (one row; B rows are run as one batch):

    prompt            "123*45="
    policy turn 1     "<tool>calculator: 123*45</tool>"       sampled; loss_mask 1; the sampler's log-probs
    tool message      "<result>5535</result>"                 appended by the environment; loss_mask 0
    policy turn 2     "5535</s>"                              sampled; loss_mask 1
    reward            scored at the end, on the last policy turn only (the text after the last tool
                      message): the answer counts only when the policy states it itself

The call format is rl.envs.tools' `<tool>NAME: INPUT</tool>`; the sampler stops at the close tag. A turn
without a call (EOS, or the token budget) ends the episode, as does the `max_turns`-th policy turn (a
call there is not run: nothing could read its result). The token budget `max_new_tokens` covers the
whole episode, tool messages included, so shapes stay those of a one-turn rollout of that length.

Tool messages (`ToolMathEnv.tool_message`, rl.envs.tools.tool_message_text) are `<result>RESULT</result>`
in plain format, or with `chat_format` the tokenizer's own chat template for a `tool` message (the text
it puts between the assistant's turn and the next assistant header: `\n<|tool|>\nRESULT\n<|assistant|>\n`
for rl/models/tiny.py's template), so real instruct models see the role they were trained with. Their
tokens are attended but are no actions of the policy: the rollout labels them -100, so they are out of
the loss and the KL exactly as prompt tokens are (see rl.rollout.episodes; tests/unit/envs/test_tools.py).

Rewards (`ToolMathEnv`, a MathProblemEnv scored on the last policy turn): correctness (weight 1.0),
formatting (weight 0 by default) and tool_use (1.0 when the episode called a tool; weight 0 by default,
so rewards/tool_use/mean is the tool-call rate, a metric). The `python` tool runs only in the sandbox,
under a private root unless `sandbox: unisolated`. `sft_records(tool_fraction=...)` gives a teacher's
SFT pairs whose completions are exactly the policy's own turns.
"""

from __future__ import annotations

import random
from typing import Sequence

from rl.envs.base import register_env
from rl.envs.code import check_sandbox
from rl.envs.math import MathProblemEnv, load_math_problems, problem_split
from rl.envs.tools import (
    TOOLS,
    final_turn,
    parse_tool_call,
    python_tool,
    run_tool,
    tool_message_text,
)


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


@register_env("tool_math")
def create_tool_math_env(tokenizer, problems_path: str | None = None, num_problems: int = 1000,
                         digits: Sequence[int] = (3, 2), answer_digits: int | None = None, seed: int = 0,
                         split: str = "train",
                         holdout_fraction: float = 0.2, tools: Sequence[str] = ("calculator",), max_turns: int = 2,
                         chat_format: bool = False, tool_use_weight: float = 0.0, correctness_weight: float = 1.0,
                         formatting_weight: float = 0.0, sandbox: str = "isolated", python_timeout: float = 5.0,
                         max_length: int = 128, max_examples: int | None = None) -> ToolMathEnv:
    """`env_type: tool_math`: products of a `digits[0]`-digit and a `digits[1]`-digit number (seeded;
    `split` train/test are disjoint by problem text, as the math environment's) or `problems_path`
    ({"problem","answer"} rows), prompt "a*b=", tools from rl.envs.tools, up to `max_turns` policy turns.
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
