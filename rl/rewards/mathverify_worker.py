"""A child process that answers "does `pred` state `gold`?" with math-verify, one JSON line at a time.

Run by `rl.rewards.answers.MathVerifier` as `python rl/rewards/mathverify_worker.py` (by path, so `rl/__init__` and its
imports stay out of the child). Protocol: the worker prints `ready` once math-verify is imported; then
for each request line `{"gold": str, "pred": str}` it prints `1` (equivalent) or `0`.

Why a process: math-verify bounds its sympy work with `signal.alarm`, which works only on a main thread
(the trainers score rewards on worker threads, where the alarm would raise and every answer would read
as wrong), and a single big-integer operation (`2^{2^{2^{10}}}`) cannot be interrupted even by a signal.
Here the alarm runs on this process's main thread, and the parent kills the whole process when an answer
takes longer than its deadline.
"""

import json
import sys

# Seconds for math-verify's own alarms (parsing each side, then comparing); the parent's deadline,
# larger, is the backstop when an alarm cannot fire.
PARSE_TIMEOUT_S = 3
VERIFY_TIMEOUT_S = 3


def main() -> None:
    from math_verify import parse, verify

    def read(text: str) -> list:
        # as one math expression first; else math-verify's own extraction finds the LaTeX in prose
        # ("2\sqrt{2} because ...")
        return parse(f"${text}$", parsing_timeout=PARSE_TIMEOUT_S) or parse(text, parsing_timeout=PARSE_TIMEOUT_S)

    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        gold, pred = read(req["gold"]), read(req["pred"])
        ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=VERIFY_TIMEOUT_S)
        print("1" if ok else "0", flush=True)


if __name__ == "__main__":
    main()
