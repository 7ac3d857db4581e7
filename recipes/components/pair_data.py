"""The pairs of recipes/data/pairs.jsonl: small arithmetic questions, each with a right answer (`chosen`) and a
wrong one (`rejected`), as TRL's conversational preference data is laid out: `prompt` the conversation before
the answer (some with a system message, some with an earlier question answered), `chosen` and `rejected` the
assistant's message. Made by a seeded generator, so that the file is the same each time it is written:

    python -m recipes.components.pair_data recipes/data/pairs.jsonl [--n 40]

Docs: docs/text-data.md (in the source tree), Preference pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any, Dict

from recipes.components.chat_data import OPS, SYSTEMS


def question(rng: random.Random):
    a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice(list(OPS))
    return f"What is {a} {op} {b}?", f"{a} {op} {b}", OPS[op](a, b)


def pair(rng: random.Random) -> Dict[str, Any]:
    prompt = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    if rng.random() < 0.3:  # an earlier turn: context, never a target
        asked, said, value = question(rng)
        prompt += [{"role": "user", "content": asked}, {"role": "assistant", "content": f"{said} is {value}."}]
    asked, said, value = question(rng)
    prompt.append({"role": "user", "content": asked})
    wrong = value + rng.choice([-3, -2, -1, 1, 2, 3, 10])
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": f"{said} is {value}."}],
            "rejected": [{"role": "assistant", "content": f"{said} is {wrong}."}]}


def write(path: str, n: int = 40, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(pair(rng)) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.components.pair_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--n", type=int, default=40, help="pairs")
    args = parser.parse_args(argv)
    write(args.path, args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
