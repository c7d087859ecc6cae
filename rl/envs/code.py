"""The code environment (`env_type: code`): function-writing problems (built in, or "prompt" + "tests"
rows of a file) whose completions are scored for syntax, style and, with run_tests=True, unit tests
run only in the sandbox (rl.envs.sandbox).

Components (`CodeGenerationEnv`, a MultiObjectiveRewardEnv): `syntax` 1.0 for non-empty code that
parses (`extract_code` takes the first fenced block, `parse_code` only parses: nothing runs), `style`
the fraction of simple checks `style_score` passes, `tests` the fraction of the problem's unit tests
that pass; default weights 1.0, 0.1 and 1.0.

Unit tests: each is one assert statement of the forms `parse_unit_test` accepts (a call with literal
arguments, compared with a literal), split in two. The sandbox runs the candidate and the calls only
(`_HARNESS`) and returns the repr of each value; the comparison with the expected value happens here
(`unit_test_passes`, with `ast.literal_eval`, so no returned text runs). Expected values never enter
the sandbox: reading its own source, the harness, its environment, the file system or /proc reveals
none, and printing fake result lines gains nothing (only the first line per call counts).

Security: generated code runs only under a private root (`sandbox: isolated`, the default);
`check_sandbox` refuses to build the environment where there is none, unless the config says
`sandbox: unisolated` (resource limits only, this machine's files visible; one warning line says so).

Deviation from the reference implementation (see shared/reference/README.md): the reference only
calls `compile()`, so an empty string scores 1.0; here only non-empty code that parses earns `syntax`,
and unit tests never run in the trainer's process.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import operator
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rl.data.records import read_records
from rl.envs import isolation, sandbox
from rl.envs.base import register_env
from rl.envs.objectives import NAMED_COMPONENTS, MultiObjectiveRewardEnv
from rl.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- code

DEFAULT_CODE_PROBLEMS = [
    {"prompt": "Write a Python function add(a, b) that returns the sum of a and b.",
     "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]},
    {"prompt": "Write a Python function factorial(n) that returns n! for n >= 0.",
     "tests": ["assert factorial(0) == 1", "assert factorial(1) == 1", "assert factorial(5) == 120"]},
    {"prompt": "Write a Python function is_palindrome(s) that returns True when the string s reads the same "
               "backwards.",
     "tests": ["assert is_palindrome('abba')", "assert not is_palindrome('abc')", "assert is_palindrome('')"]},
    {"prompt": "Write a Python function fizzbuzz(n) that returns 'Fizz' for multiples of 3, 'Buzz' for "
               "multiples of 5, 'FizzBuzz' for both, else str(n).",
     "tests": ["assert fizzbuzz(3) == 'Fizz'", "assert fizzbuzz(10) == 'Buzz'", "assert fizzbuzz(15) == 'FizzBuzz'",
               "assert fizzbuzz(7) == '7'"]},
    {"prompt": "Write a Python function max_of(xs) that returns the largest number in the non-empty list xs.",
     "tests": ["assert max_of([1, 5, 2]) == 5", "assert max_of([-3, -7]) == -3", "assert max_of([4]) == 4"]},
]


def extract_code(completion: str, prompt: str = "") -> str:
    """The code in a completion: inside the first fenced block, or up to the closing fence when the
    prompt opened one, else the whole completion."""
    if prompt.count("```") % 2 == 1:
        return completion.split("```", 1)[0]
    m = re.search(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", completion, re.S)
    return m.group(1) if m else completion


def parse_code(code: str) -> ast.Module | None:
    """The AST of non-empty code, or None when it does not parse (never executes anything)."""
    if not code.strip():
        return None
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return tree if tree.body else None


def style_score(code: str, tree: ast.Module | None = None) -> float:
    """Fraction of simple style checks passed (0.0 for code that does not parse): defines a function
    or class, every function has a docstring, lines <= 100 chars, no tabs or trailing spaces, no bare
    `except:`, no `import *`."""
    tree = tree or parse_code(code)
    if tree is None:
        return 0.0
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = code.splitlines()
    checks = [
        any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body),
        bool(funcs) and all(ast.get_docstring(f) for f in funcs),
        all(len(line) <= 100 for line in lines),
        all("\t" not in line and line == line.rstrip() for line in lines),
        not any(isinstance(n, ast.ExceptHandler) and n.type is None for n in ast.walk(tree)),
        not any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree)),
    ]
    return sum(checks) / len(checks)


# The multi_objective environment's named components for code (next to correctness, formatting, ...).
NAMED_COMPONENTS.update(
    syntax=lambda prompt, generated, full_text: 1.0 if parse_code(extract_code(generated, prompt)) else 0.0,
    style=lambda prompt, generated, full_text: style_score(extract_code(generated, prompt)))


_AST_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
            ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
# `3 == f(x)` is `f(x) == 3`: the comparison seen from the call's side.
_MIRRORED = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<=", "in": "contains",
             "not in": "not contains", "is": "is", "is not": "is not"}
UNIT_TEST_FORMS = "`assert f(1, 2) == 3`, `assert f('a')` or `assert not f('a')`"
RESULT_PREFIX = "__rl_result__ "
MAX_RESULT_CHARS = 100_000  # a longer repr counts as a failed test (and is never parsed)


# A unit test is `assert f(<literals>) <op> <literal>` (or `assert f(...)` / `assert not f(...)`): the call
# runs in the sandbox, the comparison here, so an expected value never enters the sandbox.
_TEST_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "truthy": lambda actual, _: bool(actual), "falsy": lambda actual, _: not actual,
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
    ">=": operator.ge, "in": lambda actual, expected: actual in expected,
    "not in": lambda actual, expected: actual not in expected,
    "contains": lambda actual, expected: expected in actual,
    "not contains": lambda actual, expected: expected not in actual,
    "is": operator.is_, "is not": operator.is_not,
}


@dataclass(frozen=True)
class UnitTest:
    """One assert statement split in two: `function(*args, **kwargs)` (source texts of literals) runs
    in the sandbox; `op` and `expected` stay here and judge the repr the sandbox returns."""

    source: str
    function: str
    args: tuple[str, ...]
    kwargs: tuple[tuple[str, str], ...]
    op: str
    expected: Any = None


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _call_with_literals(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and all(not isinstance(a, ast.Starred) and _is_literal(a) for a in node.args)
            and all(k.arg is not None and _is_literal(k.value) for k in node.keywords))


@functools.lru_cache(maxsize=4096)
def parse_unit_test(test: str) -> UnitTest:
    """Split `test` (one assert statement) into the call the sandbox runs and the check made here.

    Accepted: `assert f(<literals>)`, `assert not f(<literals>)` and `assert f(<literals>) <op> <literal>`
    (either side) with one of == != < <= > >= in, not in, is, is not (`is` only with None/True/False).
    Anything else (several statements, a non-literal expected value, an expression around the call)
    is a ValueError: it would put the expected value, or code that can be subverted, in the sandbox."""
    def bad(why: str) -> ValueError:
        return ValueError(f"unit test {test!r}: {why}; write each test as {UNIT_TEST_FORMS} "
                          "(a call with literal arguments, compared with a literal)")

    try:
        tree = ast.parse(test.strip())
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise bad("is not valid Python") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise bad("is not a single assert statement")
    expr, op, expected = tree.body[0].test, "truthy", None
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr, op = expr.operand, "falsy"
    elif isinstance(expr, ast.Compare):
        if len(expr.ops) != 1 or type(expr.ops[0]) not in _AST_OPS:
            raise bad("compares more than two values")
        op, left, right = _AST_OPS[type(expr.ops[0])], expr.left, expr.comparators[0]
        if _call_with_literals(left) and _is_literal(right):
            expr, expected = left, ast.literal_eval(right)
        elif _call_with_literals(right) and _is_literal(left):
            expr, expected, op = right, ast.literal_eval(left), _MIRRORED[op]
        else:
            raise bad("does not compare a call with a literal")
        if op in ("is", "is not") and not any(expected is c for c in (None, True, False)):
            raise bad("uses `is` with a value other than None, True or False")
    if not _call_with_literals(expr):
        raise bad("does not test a call with literal arguments")
    return UnitTest(source=test, function=expr.func.id, args=tuple(ast.unparse(a) for a in expr.args),
                    kwargs=tuple((k.arg, ast.unparse(k.value)) for k in expr.keywords), op=op, expected=expected)


# The sandboxed program: run the candidate, then each call, and print one result line per call:
# {"i": index, "repr": repr(value)} or {"i": index, "error": exception name}. It holds no expected
# value, so nothing in the sandbox (this file, the candidate, its environment, /proc) reveals one.
_HARNESS = r"""
import ast, json, sys
PREFIX, LIMIT = %r, %d
calls = json.loads(open("calls.json", encoding="utf-8").read())
out = sys.stdout
def emit(i, **result):
    out.write("\n" + PREFIX + json.dumps({"i": i, **result}) + "\n")
    out.flush()
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    source = open("solution.py", encoding="utf-8").read()
    exec(compile(source, "solution.py", "exec"), namespace)
except BaseException as e:
    for i in range(len(calls)):
        emit(i, error=type(e).__name__)
    raise SystemExit(0)
for i, (name, args, kwargs) in enumerate(calls):
    try:
        value = namespace[name](*[ast.literal_eval(a) for a in args],
                                **{k: ast.literal_eval(v) for k, v in kwargs})
        text = repr(value)
        emit(i, repr=text) if len(text) <= LIMIT else emit(i, error="ResultTooLarge")
    except BaseException as e:
        emit(i, error=type(e).__name__)
""" % (RESULT_PREFIX, MAX_RESULT_CHARS)


def read_results(stdout: str, n: int) -> list[dict | None]:
    """The first well-formed result line for each of the `n` calls (None where there is none)."""
    results: list[dict | None] = [None] * n
    for line in stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            continue
        try:
            r = json.loads(line[len(RESULT_PREFIX):])
        except (ValueError, RecursionError):
            continue
        i = r.get("i") if isinstance(r, dict) else None
        if type(i) is int and 0 <= i < n and results[i] is None:
            results[i] = r
    return results


def unit_test_passes(test: UnitTest, result: dict | None) -> bool:
    """Whether the sandbox's result for `test` satisfies it. The repr is read back with
    `ast.literal_eval` (plain literals only, no code runs here), so a value that is not a literal
    (a custom object, a NumPy array) fails."""
    text = result.get("repr") if isinstance(result, dict) else None
    if not isinstance(text, str) or len(text) > MAX_RESULT_CHARS:
        return False
    try:
        actual = ast.literal_eval(text)
        return bool(_TEST_OPS[test.op](actual, test.expected))
    except Exception:  # noqa: BLE001 - malformed or incomparable values are failed tests, whatever the error
        return False


def run_unit_tests(code: str, tests: Sequence[str], timeout: float = 5.0, memory_mb: int = 512,
                   require_private_root: bool = True) -> float:
    """Fraction of `tests` (assert statements, see `parse_unit_test`) that `code` passes, run only in
    rl.envs.sandbox.

    The sandbox gets the candidate, the function names and the literal arguments, and returns the
    repr of each call's value; the comparison with the expected value happens here. Reading its own
    source, the harness, its environment, the file system or /proc reveals no expected value, and
    printing result lines gains nothing: only the first line per call counts, and it must hold the
    right value. A test that does not parse counts as failed (environments reject them up front).
    `require_private_root=False` runs without a private root where there is none (see rl.envs.sandbox)."""
    if not tests:
        return 0.0
    parsed = []
    for t in tests:
        try:
            parsed.append(parse_unit_test(t))
        except ValueError:
            parsed.append(None)
    runnable = [u for u in parsed if u is not None]
    if not runnable:
        return 0.0
    calls = [[u.function, list(u.args), [list(kv) for kv in u.kwargs]] for u in runnable]
    result = sandbox.run_python(_HARNESS, timeout=timeout, memory_mb=memory_mb,
                                files={"solution.py": code, "calls.json": json.dumps(calls)},
                                require_private_root=require_private_root)
    outcomes = read_results(result.stdout, len(runnable))
    return sum(unit_test_passes(u, r) for u, r in zip(runnable, outcomes)) / len(tests)


SANDBOX_MODES = ("isolated", "unisolated")


def check_sandbox(mode: str) -> None:
    """Refuse to run generated code without a private root unless `mode` is 'unisolated' (then say
    once, in one line, what that means)."""
    level = isolation.isolation_level()
    if level == "private-root":
        return
    if mode != "unisolated":
        raise ConfigError(f"sandbox: {isolation.NO_PRIVATE_ROOT}")
    logger.warning("sandbox: unisolated: generated code runs with resource limits only (isolation %r) and can "
                   "read and write this machine's files", level)


class CodeGenerationEnv(MultiObjectiveRewardEnv):
    """Components: `syntax` (1.0 for non-empty code that parses), `style` (style_score), and with
    run_tests=True `tests` (fraction of metadata['tests'] passing in the sandbox).

    sandbox='isolated' (the default) runs generated code only under a private root (rl.envs.sandbox) and
    refuses to start where there is none; 'unisolated' runs it with resource limits only."""

    def __init__(self, tokenizer, problems: list[dict], run_tests: bool, weights: dict[str, float],
                 timeout: float, memory_mb: int, max_workers: int, sandbox: str = "isolated", **kwargs):
        if sandbox not in SANDBOX_MODES:
            raise ConfigError(f"sandbox: {sandbox!r} is not one of {', '.join(SANDBOX_MODES)}")
        self.run_tests, self.timeout, self.memory_mb, self.max_workers = run_tests, timeout, memory_mb, max_workers
        self.sandbox = sandbox
        prompts = [p["prompt"] for p in problems]
        metadata = [{"tests": list(p.get("tests") or [])} for p in problems]
        components = {"syntax": self._syntax, "style": self._style}
        if run_tests:
            for m in metadata:
                for t in m["tests"]:
                    parse_unit_test(t)  # a ValueError naming the test and the accepted forms
            check_sandbox(sandbox)
            components["tests"] = self._tests
        super().__init__(tokenizer, prompts, reward_components=components,
                         reward_weights={k: v for k, v in weights.items() if k in components},
                         metadata=metadata, **kwargs)

    def _syntax(self, prompts, responses, metadata=None):
        return [1.0 if parse_code(extract_code(r, p)) is not None else 0.0 for p, r in zip(prompts, responses)]

    def _style(self, prompts, responses, metadata=None):
        return [style_score(extract_code(r, p)) for p, r in zip(prompts, responses)]

    def _tests(self, prompts, responses, metadata=None):
        def one(args):
            p, r, m = args
            code = extract_code(r, p)
            if parse_code(code) is None or not m.get("tests"):
                return 0.0  # nothing worth a subprocess
            return run_unit_tests(code, m["tests"], timeout=self.timeout, memory_mb=self.memory_mb,
                                  require_private_root=self.sandbox == "isolated")

        jobs = list(zip(prompts, responses, metadata))
        with ThreadPoolExecutor(max_workers=max(1, self.max_workers)) as pool:
            return list(pool.map(one, jobs))


@register_env("code")
def create_code_generation_env(tokenizer, problems_path: str | None = None, run_tests: bool = False,
                               syntax_weight: float = 1.0, style_weight: float = 0.1, tests_weight: float = 1.0,
                               timeout: float = 5.0, memory_mb: int = 512, max_workers: int = 2,
                               max_length: int = 512, max_examples: int | None = None, sandbox: str = "isolated",
                               **kwargs) -> CodeGenerationEnv:
    """A code environment over built-in function-writing problems or `problems_path` (rows with
    "prompt" and optional "tests": a list of assert statements in the forms of `parse_unit_test`).
    Unit tests run only with run_tests=True, each completion in its own sandboxed subprocess
    (`timeout` s, `memory_mb` MiB), under a private root unless sandbox='unisolated'."""
    if problems_path:
        problems = []
        rows = read_records(problems_path)
        for row in rows[:max_examples] if max_examples else rows:
            where = f"{problems_path}:{row.get('_line')}"
            if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise DataError(f"{where}: 'prompt' must be a non-empty string")
            tests = row.get("tests") or []
            if isinstance(tests, str):
                tests = [tests]
            if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
                raise DataError(f"{where}: 'tests' must be a list of strings (assert statements)")
            for t in tests if run_tests else ():
                try:
                    parse_unit_test(t)
                except ValueError as e:
                    raise DataError(f"{where}: {e}") from None
            problems.append({"prompt": row["prompt"], "tests": tests})
    else:
        problems = DEFAULT_CODE_PROBLEMS
    weights = {"syntax": syntax_weight, "style": style_weight, "tests": tests_weight}
    return CodeGenerationEnv(tokenizer, problems, run_tests=run_tests, weights=weights, timeout=timeout,
                             memory_mb=memory_mb, max_workers=max_workers, max_length=max_length, sandbox=sandbox,
                             **kwargs)
