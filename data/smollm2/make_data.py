"""Writes the small chat-format data files of recipes/smollm2/ (seeded, so reruns give the same files).

    python data/smollm2/make_data.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def problems(rng, n):
    out = []
    while len(out) < n:
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        if (a, b) not in out:
            out.append((a, b))
    return out


def write(name, rows):
    with open(HERE / name, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main():
    rng = random.Random(0)
    ps = problems(rng, 160)
    train, test = ps[:128], ps[128:]
    q = "What is {a} + {b}?"
    write("sft_chat.jsonl", [{"messages": [{"role": "user", "content": q.format(a=a, b=b)},
                                           {"role": "assistant", "content": f"{a} + {b} = {a + b}"}]}
                             for a, b in train[:64]])
    wrong = lambda a, b: a + b + rng.choice([-10, -2, -1, 1, 2, 10])  # noqa: E731
    write("dpo_pairs.jsonl", [{"prompt": [{"role": "user", "content": q.format(a=a, b=b)}],
                               "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}"}],
                               "rejected": [{"role": "assistant", "content": f"{a} + {b} = {wrong(a, b)}"}]}
                              for a, b in train[:64]])
    write("reward_pairs.jsonl", [{"prompt": q.format(a=a, b=b) + " ", "chosen": f"{a} + {b} = {a + b}",
                                  "rejected": f"{a} + {b} = {wrong(a, b)}"} for a, b in train[64:128]])
    write("math_train.jsonl", [{"problem": f"{a} + {b}", "answer": str(a + b)} for a, b in train])
    write("math_test.jsonl", [{"problem": f"{a} + {b}", "answer": str(a + b)} for a, b in test])


if __name__ == "__main__":
    main()
