"""The conversations of recipes/data/chat.jsonl: small arithmetic questions and their answers, one to three
turns, some with a system message, as chat SFT data is laid out (a `messages` column of {role, content}).
Made by a seeded generator, so that the file is the same each time it is written:

    python -m recipes.components.chat_data recipes/data/chat.jsonl [--n 400]

Docs: docs/text-data.md (in the source tree).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Dict, List

SYSTEMS = ["You are a helpful assistant who answers in one sentence.", "Answer with the number and a short sentence."]
OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def conversation(rng: random.Random) -> List[Dict[str, str]]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice(list(OPS))
        messages.append({"role": "user", "content": f"What is {a} {op} {b}?"})
        answer = f"{a} {op} {b} is {OPS[op](a, b)}."
        if rng.random() < 0.2:
            answer += f" So the answer is {OPS[op](a, b)}, which you can check by working it out again."
        messages.append({"role": "assistant", "content": answer})
    return messages


def write(path: str, n: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"messages": conversation(rng)}) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.components.chat_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--n", type=int, default=400, help="conversations")
    args = parser.parse_args(argv)
    write(args.path, args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
