r"""Answer checking for verifiable rewards: extracting the answer a completion states, and deciding
whether it equals the expected one.

Answer extraction order (`extract_answer`): the last `\boxed{...}` (nested braces allowed), else the text
after the last `Answer:` / `answer is` / `####` marker on its line, else the last number in the text.
A marked answer holding several different numbers ("Answer: 19 or 20") is ambiguous and matches
nothing, so hedging earns no reward; an equation keeps what follows its last "=" ("Answer: 12+7=19").
Comparison (`answers_match`) has a fast path, exact on rationals (`fractions.Fraction`): "0.5", "1/2",
"\frac{1}{2}" and "+.50" are equal; "1,234" is one thousand two hundred thirty-four. Text with no number
("incorrect") never matches a number. LaTeX the fast path cannot read (`\sqrt`, `\pi`, polynomials,
sets, intervals, `10\%`) goes to Hugging Face's math-verify (sympy equivalence), run in a child process
with a deadline (`MathVerifier`, rl/rewards/mathverify_worker.py: its signal-based timeouts need a main
thread, and rewards are scored on worker threads). Plain words compare as normalised text (math-verify
would read "Paris" as p*a*r*i*s).

`has_answer_format` is the formatting check of the math environments: 'answer' (an `Answer: <number>`
line), 'boxed' (a `\boxed{}` holding a number or LaTeX math) or 'plain' (exactly one number).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import logging
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
from fractions import Fraction
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


# A number not glued to a preceding word/number (so the "-" in "3-1" is an operator, not a sign):
# optional sign, thousands groups or digits with optional decimals, optional "/denominator".
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?|\.\d+)"
NUMBER_RE = re.compile(rf"(?:(?<![\w.)\]}}])[-+\u2212])?{_NUM}(?:\s*/\s*{_NUM})?")
_SINGLE_NUMBER_RE = re.compile(rf"[-+]?{_NUM}(?:/{_NUM})?")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_MARKER_RE = re.compile(r"(?:answer\s*(?:is)?\s*[:=]|answer\s+is|####)", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with balanced nested braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1].strip() if depth == 0 else None


def _clean(s: str) -> str:
    """LaTeX fractions to a/b, drop $, \\!, thousands-free spacing, unicode minus to '-'."""
    s = _FRAC_RE.sub(r"(\1)/(\2)", s)
    s = s.replace("\u2212", "-").replace("\\!", "").replace("$", "").replace("\\%", "%")
    return re.sub(r"\((\s*[-+]?[\d.,]+\s*)\)", r"\1", s)  # "(1)/(2)" -> "1/2"


def find_numbers(text: str) -> list[str]:
    """Every number in `text` in order, as written (after LaTeX cleanup): '12', '-3', '1/2', '0.25'."""
    return [m.group(0) for m in NUMBER_RE.finditer(_clean(text))]


def parse_number(text: Any) -> Fraction | None:
    """A single number as an exact Fraction ("-1/2", "0.50", "1,234", "$5", "50%" -> 50), else None.

    Floats go through their shortest repr, so 0.1 parses as 1/10 rather than its binary expansion."""
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, Fraction)):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(repr(text)) if text == text and abs(text) != float("inf") else None
    s = _clean(str(text)).strip().rstrip(".").rstrip("%").strip()
    s = re.sub(r"\s*/\s*", "/", re.sub(r"^([-+])\s+", r"\1", s))
    if not _SINGLE_NUMBER_RE.fullmatch(s):  # "5 6", "3,4", "12+7" are not one number
        return None
    sign = -1 if s[0] == "-" else 1
    num, _, den = s.lstrip("+-").replace(",", "").partition("/")
    try:
        value = Fraction(num) / (Fraction(den) if den else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return sign * value


def extract_answer(text: str) -> str | None:
    """The answer string of a completion: last \\boxed{}, else after the last answer marker, else the
    last number; None when there is none."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    markers = list(_MARKER_RE.finditer(text))
    if markers:
        rest = text[markers[-1].end():].strip().split("\n", 1)[0].strip()
        if rest:
            return rest
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def answer_value(answer: str | None) -> Fraction | None:
    """The single number an extracted answer states; None if it states none or several different ones."""
    if answer is None:
        return None
    value = parse_number(answer)
    if value is not None:
        return value
    if "=" in answer:  # "12+7=19": the result is what follows the last "="
        answer = answer.rsplit("=", 1)[1]
    values = {parse_number(n) for n in find_numbers(answer)}
    values.discard(None)
    return values.pop() if len(values) == 1 else None


def _normalise_text(s: str) -> str:
    return re.sub(r"\s+", " ", str(s)).strip().strip(".").lower()


# LaTeX or symbolic notation the exact-number path does not read; plain words never go to math-verify
_LATEX_RE = re.compile(r"[\\^{}\u03c0\u221a]|\bsqrt\b|\bpi\b")
_MATHY_RE = re.compile(r"[\d+*/=()^\\{}\u03c0\u221a-]")
MAX_VERIFY_CHARS = 1000  # longer answers are not sent to math-verify (sympy time grows with length)


def _exact(got: Fraction | None, want: Fraction, rel_tol: float) -> bool:
    if got is None:
        return False
    return abs(got - want) <= rel_tol * max(1, abs(want)) if rel_tol else got == want


def answers_match(predicted: Any, expected: Any, rel_tol: float = 0.0) -> bool:
    """Whether a completion (or an extracted answer) states `expected`.

    1. Fast path, no LaTeX: a numeric `expected` compares exactly as rationals (or within `rel_tol`
       relative) with the number the answer states (hedged "19 or 20" states none); a plain-word
       `expected` compares as normalised text (case, spacing, trailing period).
    2. Otherwise (an answer or `expected` in LaTeX or symbols: `2\\sqrt{2}`, `\\frac{\\pi}{2}`,
       `x^2+1`, `\\{1,2\\}`, `10\\%`): math-verify's equivalence, gold = `expected`, prediction = the
       extracted answer (see `MathVerifier`)."""
    if predicted is None:
        return False
    want = parse_number(expected)
    if isinstance(predicted, Fraction):
        return want is not None and _exact(predicted, want, rel_tol)
    answer = extract_answer(str(predicted))
    answer = str(predicted).strip() if answer is None else answer  # a bare word answer has no marker
    if not answer.strip():
        return False
    expected_text = str(expected).strip()
    if want is not None:
        got = parse_number(answer)  # the whole answer is one number ("\\frac{1}{2}", "$5" included)
        if got is not None and (_exact(got, want, rel_tol) or "%" not in answer + expected_text):
            return _exact(got, want, rel_tol)
        if not _LATEX_RE.search(answer + expected_text) and "%" not in answer + expected_text:
            return _exact(answer_value(answer), want, rel_tol)
        if not re.search(r"\d|\\pi|\u03c0", answer):  # no number at all: nothing to verify
            return False
    elif _normalise_text(answer) == _normalise_text(expected_text):
        return True
    elif not (_MATHY_RE.search(expected_text) or _MATHY_RE.search(answer)):
        return False  # plain words that differ
    if len(answer) > MAX_VERIFY_CHARS or len(expected_text) > MAX_VERIFY_CHARS:
        return False
    return math_verifier().equivalent(expected_text, answer.strip().strip("$").strip())


class MathVerifier:
    """math-verify's `verify(parse(gold), parse(pred))` in a child process with a deadline.

    math-verify bounds sympy with `signal.alarm`, which raises off the main thread (and the trainers
    score rewards on worker threads) and cannot interrupt one huge big-integer operation. So the check
    runs in `rl/rewards/mathverify_worker.py`, where the alarm works; when an answer takes longer than
    `deadline_s` the child is killed, the answer counts as not matching (with one warning), and the
    next call starts a new child. Calls from several threads take turns (a lock); the child starts on
    the first call that needs it (~3 s: it imports sympy) and ends with this process."""

    WORKER = Path(__file__).with_name("mathverify_worker.py")

    def __init__(self, deadline_s: float = 15.0, start_timeout_s: float = 120.0):
        self.deadline_s, self.start_timeout_s = deadline_s, start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._warned = False

    def equivalent(self, gold: str, pred: str) -> bool:
        """True when math-verify judges `pred` equal to `gold` (both LaTeX or plain math, no `$`)."""
        with self._lock:
            proc = self._start()
            try:
                proc.stdin.write(json.dumps({"gold": gold, "pred": pred}) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):  # the child died since the last call: start another
                self.close()
                proc = self._start()
                proc.stdin.write(json.dumps({"gold": gold, "pred": pred}) + "\n")
                proc.stdin.flush()
            reply = self._readline(proc, self.deadline_s)
            if reply is None:
                self.close()
                if not self._warned:
                    logger.warning("math-verify took over %.0f s on answer %r (expected %r); counted as "
                                   "not matching", self.deadline_s, pred[:80], gold[:80])
                    self._warned = True
                return False
            return reply == "1"

    def _start(self) -> subprocess.Popen:
        if self._proc is not None and self._owner != os.getpid():
            self._proc = None  # a forked copy of this object: the child's pipes belong to the parent
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if importlib.util.find_spec("math_verify") is None:
            raise ImportError("math-verify is not installed (it checks LaTeX answers): "
                              "pip install 'math-verify>=0.9,<1'")
        err = tempfile.TemporaryFile()  # a file, not a pipe: a full pipe would block the child
        # its own session: a Ctrl-C meant for the trainer's lifecycle does not kill it mid-answer; it
        # ends when this process closes its stdin (even when killed: the pipe closes) or at exit
        proc = subprocess.Popen([sys.executable, str(self.WORKER)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                                start_new_session=True)
        if self._readline(proc, self.start_timeout_s) != "ready":
            proc.kill()
            proc.wait()
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the math-verify worker did not start: {tail[0]}")
        self._proc, self._owner = proc, os.getpid()
        return proc

    @staticmethod
    def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
        """The child's next line, or None if none arrives within `timeout` s (or the child died)."""
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        return line.strip() if line else None

    def close(self) -> None:
        if self._proc is not None and self._owner == os.getpid():
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                f.close()
            self._proc = None


_VERIFIER: MathVerifier | None = None
_VERIFIER_LOCK = threading.Lock()


def math_verifier() -> MathVerifier:
    """This process's MathVerifier (one child process, started on first use, ended at exit)."""
    global _VERIFIER
    with _VERIFIER_LOCK:
        if _VERIFIER is None:
            _VERIFIER = MathVerifier()
            atexit.register(_VERIFIER.close)
        return _VERIFIER


def has_answer_format(text: str, style: str = "answer") -> bool:
    """Formatting check: 'answer' (an `Answer: <number>` line), 'boxed' (\\boxed{<number>} or a LaTeX
    expression with a number or \\pi in it, which `answers_match` hands to math-verify), or 'plain'
    (the stripped completion is exactly one number)."""
    if style == "boxed":
        boxed = _last_boxed(text or "")
        if boxed is None:
            return False
        latex = bool(_LATEX_RE.search(boxed)) and bool(re.search(r"\d|\\pi|\u03c0", boxed))
        return answer_value(boxed) is not None or latex
    if style == "answer":
        return re.search(r"answer\s*:\s*[-+\u2212]?[\d.$\\]", text or "", re.IGNORECASE) is not None
    if style == "plain":
        return parse_number((text or "").strip()) is not None and bool((text or "").strip())
    raise ValueError(f"unknown answer style {style!r}; choose 'plain', 'answer' or 'boxed'")
