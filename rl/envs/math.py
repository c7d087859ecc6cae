r"""The math environment (`env_type: math`): arithmetic problems generated from a seed, or
{"problem", "answer"} rows of a file, scored by parsing the completion's answer.

`generate_arithmetic_problem` draws one problem of a difficulty (tiny: a+b with digits 0-9; easy: + or -
up to 20; medium: +, -, * up to 99; hard: (a o b) o c with exact division, fractions as answers).
`problem_split` puts a stable `holdout_fraction` of problem texts in 'test' (CRC32 of the text), so a
train and a test environment never share a problem; generated environments draw fresh problems of
their split in `sample_prompts`.

`MathProblemEnv` (a MultiObjectiveRewardEnv): reward = correctness_weight * correctness +
formatting_weight * formatting (default 1.0 and 0.1). correctness is 1.0 when the extracted answer
equals metadata['answer'] (rl.rewards.answers: exact on rationals, math-verify for LaTeX); formatting
is 1.0 when the completion has the form of `answer_format`: 'plain' exactly one number (the prompt
"12+7=", the ideal completion "19"), 'answer' an `Answer: <number>` line, 'boxed' a `\boxed{}`.
`reference_completion` and `sft_records` give the ideal completions, for an SFT warm-up.

Deviation from the reference implementation (see shared/reference/README.md): the reference rewards
the substring "correct" (so "incorrect" scores too) and never parses an answer; here the answer is
parsed and compared as a number, and text without one earns nothing.
"""

from __future__ import annotations

import logging
import random
import zlib
from typing import Callable, Sequence

from rl.data.records import read_records
from rl.envs.base import register_env
from rl.envs.objectives import MultiObjectiveRewardEnv
from rl.errors import DataError
from rl.rewards import answers as R
from rl.rewards import functions as RF

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- math

MATH_DIFFICULTIES = ("tiny", "easy", "medium", "hard")
_MATH_TEMPLATES = {
    "plain": "{problem}=",
    "answer": "Question: What is {problem}?\nThink briefly, then finish with a line 'Answer: <number>'.\n",
    "boxed": "Question: What is {problem}?\nPut the final answer in \\boxed{{}}.\n",
}


def _fmt_fraction(x) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def generate_arithmetic_problem(rng: random.Random, difficulty: str = "easy") -> tuple[str, str]:
    """One (problem, answer) pair. tiny: a+b with digits 0-9; easy: a+b or a-b up to 20 (answers may be
    negative); medium: +, -, * up to 99; hard: (a o b) o c up to 99 including exact division (answers
    may be fractions like '7/3')."""
    from fractions import Fraction

    if difficulty == "tiny":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a}+{b}", str(a + b)
    if difficulty == "easy":
        a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-")
        return f"{a}{op}{b}", str(a + b if op == "+" else a - b)
    if difficulty == "medium":
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
        return f"{a}{op}{b}", str({"+": a + b, "-": a - b, "*": a * b}[op])
    if difficulty == "hard":
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 20)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*/")
        inner = {"+": a + b, "-": a - b, "*": a * b}[op1]
        value = {"+": inner + c, "-": inner - c, "*": inner * c, "/": Fraction(inner, c)}[op2]
        return f"({a}{op1}{b}){op2}{c}", _fmt_fraction(Fraction(value))
    raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(MATH_DIFFICULTIES)}")


def problem_split(problem: str, holdout_fraction: float) -> str:
    """'test' for a stable `holdout_fraction` of problems (by CRC32 of the text), else 'train'."""
    return "test" if zlib.crc32(problem.encode()) % 10_000 < holdout_fraction * 10_000 else "train"


class MathProblemEnv(MultiObjectiveRewardEnv):
    """Arithmetic or JSONL math problems; components `correctness` (1.0 when the extracted answer equals
    metadata['answer'] numerically) and `formatting` (1.0 when the completion has the expected answer
    format); the default weights are 1.0 and 0.1."""

    def __init__(self, tokenizer, problems: list[dict], answer_format: str, prompt_template: str,
                 correctness_weight: float, formatting_weight: float, generator: Callable | None = None, **kwargs):
        if answer_format not in _MATH_TEMPLATES:
            raise ValueError(f"unknown answer_format {answer_format!r}; choose one of {', '.join(_MATH_TEMPLATES)}")
        self.answer_format = answer_format
        self.prompt_template = prompt_template
        self._generator = generator  # (rng) -> (problem, answer) for fresh problems, None for a fixed set
        self.problems = problems
        prompts = [self.make_prompt(p["problem"]) for p in problems]
        metadata = [{"problem": p["problem"], "answer": p["answer"]} for p in problems]

        def correctness(prompts, responses, metadata):
            return RF.correctness_reward(prompts, responses, metadata)

        def formatting(prompt, generated, full_text):
            return 1.0 if R.has_answer_format(generated, answer_format) else 0.0

        super().__init__(tokenizer, prompts, reward_components={"correctness": correctness, "formatting": formatting},
                         reward_weights={"correctness": correctness_weight, "formatting": formatting_weight},
                         metadata=metadata, **kwargs)

    def make_prompt(self, problem: str) -> str:
        return self.prompt_template.format(problem=problem)

    def reference_completion(self, answer: str) -> str:
        """The ideal completion for an answer in this environment's format (e.g. for SFT warm-up)."""
        formats = {"plain": f"{answer}", "answer": f"Answer: {answer}", "boxed": f"\\boxed{{{answer}}}"}
        return formats[self.answer_format]

    def sample_prompts(self, n: int, seed: int | None = None) -> list[dict]:
        """Fresh generated problems of this split when the problems are generated, else from the set."""
        if self._generator is None:
            return super().sample_prompts(n, seed)
        rng = random.Random(seed) if seed is not None else self._rng
        out = []
        for _ in range(n):
            problem, answer = self._generator(rng)
            out.append({"prompt": self.make_prompt(problem), "metadata": {"problem": problem, "answer": answer}})
        return out

    def sft_records(self, n: int | None = None, seed: int | None = None) -> list[dict]:
        """{"prompt", "completion"} pairs with reference completions (all fixed problems when n is None)."""
        batch = ([{"prompt": p, "metadata": m} for p, m in zip(self.prompts, self.metadata)] if n is None
                 else self.sample_prompts(n, seed))
        return [{"prompt": b["prompt"], "completion": self.reference_completion(b["metadata"]["answer"])}
                for b in batch]

    def _score_batch(self, prompts, gens, metas):
        missing = [i for i, m in enumerate(metas) if "answer" not in m]
        if missing:
            raise ValueError(f"math environment: no 'answer' for completion {missing[0]} (prompt "
                             f"{prompts[missing[0]]!r}); pass metadata from env.sample_prompts()")
        return super()._score_batch(prompts, gens, metas)


def load_math_problems(path: str, max_examples: int | None = None) -> list[dict]:
    """{"problem", "answer"} rows of a JSONL/JSON/CSV/parquet file; answers may be numbers or strings."""
    rows = read_records(path)
    out = []
    for row in rows[:max_examples] if max_examples else rows:
        where = f"{path}:{row.get('_line')}"
        problem, answer = row.get("problem"), row.get("answer")
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"{where}: 'problem' must be a non-empty string")
        if answer is None or isinstance(answer, (bool, list, dict)) or str(answer).strip() == "":
            raise DataError(f"{where}: 'answer' must be a number or a non-empty string")
        out.append({"problem": problem, "answer": str(answer).strip()})
    if not out:
        raise DataError(f"{path}: no problems")
    return out


@register_env("math")
def create_math_problem_env(tokenizer, problems_path: str | None = None, num_problems: int = 1000,
                            difficulty: str = "easy", seed: int = 0, split: str = "train",
                            holdout_fraction: float = 0.2, answer_format: str = "plain",
                            prompt_template: str | None = None, correctness_weight: float = 1.0,
                            formatting_weight: float = 0.1, max_length: int = 128,
                            stop_sequences: Sequence[str] | None = None, max_examples: int | None = None,
                            **kwargs) -> MathProblemEnv:
    """A math environment: `num_problems` generated arithmetic problems (seeded; `split` 'train' or 'test'
    picks a disjoint, stable `holdout_fraction` of problem texts), or `problems_path` (JSONL of
    {"problem","answer"}, used as given). Reward = correctness + 0.1 * formatting by default.

    The default prompt for answer_format='plain' is "12+7=", and the ideal completion is "19"."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    template = prompt_template or _MATH_TEMPLATES.get(answer_format, "{problem}")
    generator = None
    if problems_path:
        problems = load_math_problems(problems_path, max_examples)
    else:
        if difficulty not in MATH_DIFFICULTIES:
            raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(MATH_DIFFICULTIES)}")
        if split != "all" and not 0.0 < holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in (0, 1) for split={split!r}, got {holdout_fraction}")

        def generator(rng, _d=difficulty):
            for _ in range(100_000):
                problem, answer = generate_arithmetic_problem(rng, _d)
                if split == "all" or problem_split(problem, holdout_fraction) == split:
                    return problem, answer
            raise RuntimeError(f"no {split!r} problem found; check holdout_fraction={holdout_fraction}")

        rng = random.Random(seed)
        problems = [dict(zip(("problem", "answer"), generator(rng))) for _ in range(num_problems)]
    return MathProblemEnv(tokenizer, problems, answer_format=answer_format, prompt_template=template,
                          correctness_weight=correctness_weight, formatting_weight=formatting_weight,
                          generator=generator, max_length=max_length, stop_sequences=stop_sequences,
                          seed=seed, **kwargs)
