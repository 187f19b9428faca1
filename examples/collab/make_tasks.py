"""Generate the collaborative tasks of the CollabLLM example (seeded): `python examples/collab/make_tasks.py`.

Each row is a request that cannot be answered well without asking: the simulated user (`llm_user`) holds the
missing details in its hidden goal and gives them only when asked. Three kinds:
- `cost`: a total to compute (nights and price per night, items and price, ...): ground truth is the number;
- `message`: a short personal message to write (who, what for, the tone): ground truth is a reference text;
- `choice`: pick one of three options for a user whose needs are hidden: ground truth is the right option.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = ("You are a helpful assistant. When a request is missing details you need, ask the user for them "
          "before you answer. Keep your replies short.")


def cost(rng: random.Random) -> dict:
    kind = rng.choice(["trip", "groceries", "party"])
    if kind == "trip":
        nights, price, ticket = rng.randint(2, 6), rng.choice([60, 75, 80, 95, 120]), rng.choice([25, 40, 45, 60])
        task = "Help me work out how much my weekend trip will cost."
        goal = f"{nights} nights at ${price} per night, plus ${ticket} for the train ticket."
        total = nights * price + ticket
    elif kind == "groceries":
        items, price, coupon = rng.randint(3, 9), rng.choice([2, 3, 4, 5]), rng.choice([2, 5])
        task = "How much will I pay at the shop today?"
        goal = f"{items} bags of apples at ${price} each, and a ${coupon} coupon off the total."
        total = items * price - coupon
    else:
        guests, per_guest, venue = rng.randint(5, 20), rng.choice([8, 10, 12]), rng.choice([50, 100])
        task = "Can you tell me what my party will cost?"
        goal = f"{guests} guests, food at ${per_guest} per guest, and ${venue} for the room."
        total = guests * per_guest + venue
    return {"task": task, "goal": goal, "ground_truth": str(total), "kind": "cost"}


def message(rng: random.Random) -> dict:
    relation = rng.choice(["sister", "brother", "friend", "colleague", "grandmother"])
    name = rng.choice(["Ana", "Ben", "Chloe", "Dev", "Eli", "Fatima", "Gus"])
    occasion, wish = rng.choice([("birthday", "Happy birthday"), ("new job", "Congratulations on the new job"),
                                 ("retirement", "Happy retirement"), ("graduation", "Congratulations on graduating")])
    hobby = rng.choice(["hiking", "baking", "chess", "painting", "running"])
    tone = rng.choice(["funny", "warm", "formal"])
    task = f"Help me write a short {occasion} message for my {relation}."
    goal = f"Their name is {name}, they love {hobby}, the tone should be {tone}, and it must be two sentences at most."
    truth = f"{wish}, {name}! I hope you find plenty of time for {hobby}."
    return {"task": task, "goal": goal, "ground_truth": truth, "kind": "message"}


def choice(rng: random.Random) -> dict:
    thing, options, needs = rng.choice([
        ("laptop", ["a light 13-inch ultrabook", "a 15-inch gaming laptop", "a cheap Chromebook"],
         ["I travel every week and carry it everywhere", "I play new games every evening",
          "I only browse and my budget is $250"]),
        ("pet", ["a cat", "a dog", "a goldfish"],
         ["I work long hours but want some company", "I want a partner for morning runs",
          "I live in a tiny flat and travel a lot"]),
        ("holiday", ["a beach resort", "a city break", "a mountain cabin"],
         ["I want to rest and swim", "I love museums and restaurants", "I want quiet walks in nature"]),
    ])
    k = rng.randrange(3)
    task = f"Which {thing} should I get: {options[0]}, {options[1]} or {options[2]}?"
    goal = f"{needs[k]}. The right choice for you is {options[k]}."
    return {"task": task, "goal": goal, "ground_truth": options[k], "kind": "choice"}


def rows(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(size):
        spec = (cost, message, choice)[i % 3](rng)
        out.append({"uid": f"collab-{seed}-{i}", "data_source": f"collab_{spec['kind']}",
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": spec["task"]}],
                    "interaction": {"name": "llm_user", "task": spec["task"], "goal": spec["goal"]},
                    "ground_truth": spec["ground_truth"], "extra": {"kind": spec["kind"]}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("tasks.jsonl")))
    args = parser.parse_args()
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows(args.size, args.seed)))
    print(f"wrote {args.size} tasks to {args.out}")


if __name__ == "__main__":
    main()
