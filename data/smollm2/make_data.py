"""Writes the small chat-format data files of recipes/smollm2/ (seeded, so reruns give the same files).

    python data/smollm2/make_data.py

math_test.jsonl holds 256 held-out sums: the first 32 are the original test split (kept so that older
figures on "the 32 held-out problems" stay comparable, and recipes reading the first 32 see the same rows;
3 of them are the commuted form of a training problem, e.g. "28 + 26" beside "26 + 28"), then 224 more
drawn from their own generator (so every other file stays byte-identical) and disjoint from all 160
earlier problems in both orders.
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
        f.writelines(json.dumps(r) + "\n" for r in rows)


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
    extra_rng, taken = random.Random(1), set(ps) | {(b, a) for a, b in ps}
    while len(test) < 256:
        a, b = extra_rng.randint(2, 49), extra_rng.randint(2, 49)
        if (a, b) not in taken:
            test.append((a, b))
            taken |= {(a, b), (b, a)}
    write("math_test.jsonl", [{"problem": f"{a} + {b}", "answer": str(a + b)} for a, b in test])


if __name__ == "__main__":
    main()
