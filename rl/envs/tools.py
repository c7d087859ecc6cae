"""Tools a policy may call in the middle of its turn, the one format it calls them in, and the tool
messages that carry their results back.

Call format (one call per turn; the turn ends at the close tag, which is the sampler's stop string):

    <tool>NAME: INPUT</tool>            e.g. <tool>calculator: 123*45</tool>

Plain ASCII on purpose: a byte-level tokenizer (rl/models/tiny.py) can produce every character of it,
and a real tokenizer needs no new special tokens. NAME is an identifier; everything after the first ':'
(one leading space dropped) up to the close tag is the tool's INPUT (`parse_tool_call`). The episode
runner (rl.rollout.episodes) runs the call with `run_tool` and appends the result as a tool message
(`tool_message_text`: `<result>RESULT</result>`, or the chat template's `tool` turn); the tool never
sees anything but INPUT. `final_turn` cuts a decoded episode to the policy's last turn, which is what
gets scored.

Built-in tools (`TOOLS`; a tool is `fn(input: str) -> str`, errors are results too, so the policy can
see and learn from them; inputs over MAX_TOOL_INPUT characters are refused, results cut to
MAX_RESULT_CHARS):
    calculator   arithmetic on integer/decimal literals with + - * / // % ** and parentheses, evaluated
                 exactly (Fraction) by walking the `ast` (no eval): names, calls, attributes, subscripts,
                 strings and comparisons are rejected, exponents are bounded and results capped in size.
    python       a program run ONLY in the sandbox (rl.envs.sandbox.run_python, as the code environment's
                 unit tests are), under a private root unless told otherwise; its stdout (or the error's
                 last line) is the result.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from rl.data.chat import render_chat
from rl.envs import sandbox

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
_CALL_HEAD = re.compile(r"\s*([A-Za-z_]\w*)\s*:")  # what follows <tool> in a call: NAME, then ':' 
MAX_TOOL_INPUT = 2_000  # characters of one call's input; longer ones are refused, not run
MAX_RESULT_CHARS = 200  # characters of a tool result the policy gets back (tool messages are context)


class ToolError(ValueError):
    """A call the tool refuses: its message becomes the tool result ("error: ...")."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    input: str


def parse_tool_call(text: str) -> ToolCall | None:
    """The last complete `<tool>NAME: INPUT</tool>` in a turn's text, or None when there is none.

    A turn that opened a tag but wrote no valid call (no name, no ':', nothing closed) is no call: the
    episode then ends like a plain answer. One leading space of INPUT is dropped ("calculator: 1+2")."""
    text, last, pos = text or "", None, 0
    # The regex `<tool>\s*NAME\s*:(.*?)</tool>` (its matches, left to right), in one pass: a lazy `.*?`
    # from every unclosed `<tool>` would rescan the rest of the turn (quadratic in the turn's length).
    while (start := text.find(TOOL_OPEN, pos)) >= 0:
        head = _CALL_HEAD.match(text, start + len(TOOL_OPEN))
        if head is None:
            pos = start + 1
            continue
        close = text.find(TOOL_CLOSE, head.end())
        if close < 0:  # no `</tool>` after this head, so after no later `<tool>` either
            break
        last, pos = (head.group(1), text[head.end():close]), close + len(TOOL_CLOSE)
    if last is None:
        return None
    name, arg = last
    return ToolCall(name, arg[1:] if arg.startswith(" ") else arg)


# ------------------------------------------------------------------------------------ calculator

MAX_EXPONENT = 64  # |b| in a ** b; 2**64 is fine, 9**999999 would stall the trainer
MAX_MAGNITUDE = 10 ** 60  # intermediate and final values beyond this are refused (no giant integers)
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def _eval_node(node: ast.AST) -> Fraction:
    """Exact value of an arithmetic AST node (Fraction, so 0.1+0.2 is 3/10 and 7/2 is exact)."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"only numbers are allowed, got {node.value!r}")
        if node.value != node.value or node.value in (float("inf"), float("-inf")):
            raise ToolError("number out of range")
        value = Fraction(repr(node.value))  # from the literal's text: 0.1 is exactly 1/10
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval_node(node.operand)
        value = -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exp = _eval_node(node.left), _eval_node(node.right)
        if exp.denominator != 1:
            raise ToolError("only integer exponents are allowed")
        if abs(exp) > MAX_EXPONENT:
            raise ToolError(f"exponent {exp} is too large (at most {MAX_EXPONENT})")
        if base == 0 and exp < 0:
            raise ToolError("division by zero")
        # a cheap bound before computing: |base| ** |exp| < 2 ** (|exp| * bits); the exact size check
        # below then applies (400 bits > log2(MAX_MAGNITUDE) ~ 200 leaves the bound's slack)
        if abs(exp) * max(abs(base.numerator).bit_length(), base.denominator.bit_length()) > 400:
            raise ToolError("result is too large")
        value = base ** int(exp)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        value = Fraction(_BINOPS[type(node.op)](left, right))
    else:
        raise ToolError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")
    if abs(value) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ToolError("number out of range (too large or too precise)")
    return value


def format_number(value: Fraction) -> str:
    """An integer as itself ("5535"), anything else as a decimal of at most 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def calculator(expression: str) -> str:
    """Evaluate arithmetic exactly, e.g. "123*45" -> "5535", "7/2" -> "3.5", "2**10" -> "1024".

    Parsed with `ast.parse(mode="eval")` and walked by `_eval_node`: nothing is executed, and any node
    other than numbers, unary +/-, + - * / // % ** (raises ToolError, reported to the policy)."""
    expression = expression.strip()
    if not expression:
        raise ToolError("empty expression")
    if len(expression) > 200:
        raise ToolError("expression is longer than 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    return format_number(_eval_node(tree.body))


# ------------------------------------------------------------------------------------ python (sandboxed)

def python_tool(code: str, *, timeout: float = 5.0, memory_mb: int = 512, require_private_root: bool = True) -> str:
    """Run `code` in rl.envs.sandbox (never in this process) and return its stdout, or "error: <last line of
    stderr>" when it fails. require_private_root (the default) refuses to run without a private root."""
    try:
        result = sandbox.run_python(code, timeout=timeout, memory_mb=memory_mb,
                                    require_private_root=require_private_root)
    except RuntimeError as e:  # no private root here: a refusal, not a crash of the trainer
        raise ToolError(str(e).split(";")[0]) from None
    if result.timed_out:
        raise ToolError(f"timed out after {timeout:g} s")
    if not result.ok:
        lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
        raise ToolError(lines[-1] if lines else f"exit status {result.returncode}")
    return result.stdout.strip()


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "python": python_tool}


def run_tool(call: ToolCall, tools: dict[str, Callable[[str], str]]) -> str:
    """The result text of one call: the tool's output, or "error: ..." (unknown tool, refused input),
    cut to MAX_RESULT_CHARS. Never raises for anything the policy wrote."""
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}"
    if len(call.input) > MAX_TOOL_INPUT:
        return f"error: input longer than {MAX_TOOL_INPUT} characters"
    try:
        out = fn(call.input)
    except ToolError as e:
        out = f"error: {e}"
    return out[:MAX_RESULT_CHARS]

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


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


def final_turn(completion: str, resume: str = RESULT_CLOSE) -> str:
    """The policy's last turn of a decoded episode: what follows the last tool message, i.e. the first
    `resume` (the text a tool message ends with: `</result>`, or the chat template's assistant header)
    after the last `</tool>`; the whole completion when it has no call; "" when the last call got no
    result (it was made on the max_turns-th turn, or the budget ran out)."""
    if TOOL_CLOSE not in completion:
        return completion
    tail = completion.rsplit(TOOL_CLOSE, 1)[-1]
    return tail.split(resume, 1)[1] if resume in tail else ""
