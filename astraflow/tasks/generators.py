"""Generated prompt sources: seeded, finite, held in memory (`ItemRows`).

- `arithmetic`: every `a+b=` / `a-b=` (or sums of several operands) with operands in
  [0, max_operand]; the answer is the result, its units digit or its parity.
- `word_problems`: short English stories in the manner of GSM8K, one person's quantity of
  something changed by `operands - 1` events (buying, finding, being given: more; giving
  away, selling, losing: fewer), often with a distractor sentence whose number does not
  matter, and a question. Each item carries a worked solution, one line per event
  ("12 + 5 = 17") and a final `\\boxed{}` answer, which the supervised warm-up and reference
  guidance use; the reward checks only the boxed answer. Quantities never go negative.
"""
from __future__ import annotations

import itertools
import random
from typing import TYPE_CHECKING

from astraflow.config.schema import TaskSourceConfig

if TYPE_CHECKING:
    from astraflow.tasks.sources import Item

WORD_PROBLEMS = 20_000  # stories per source (the held-out and warm-up parts come out of them)


class ItemRows:
    """A generator's items: in memory, split by a seeded permutation."""

    def __init__(self, items: list["Item"]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> "Item":
        return self.items[index]

    def content_keys(self) -> None:
        return None


def arithmetic(cfg: TaskSourceConfig) -> ItemRows:
    """`pad_operands` writes operands zero-padded to one width ("07+15="), `reverse_answer`
    asks for the result's digits least significant first ("22" for 07+15)."""
    from astraflow.tasks.sources import Item

    m = cfg.max_operand
    width = len(str(m)) if cfg.pad_operands else 0
    show = {"full": str, "units": lambda r: str(r % 10), "parity": lambda r: str(r % 2)}[cfg.answer]

    def item(text: str, r: int) -> Item:
        answer = show(r)
        return Item(text, answer[::-1] if cfg.reverse_answer else answer)

    if cfg.operands > 2:  # sums of several operands: "3+4+2="
        return ItemRows([item("+".join(f"{x:0{width}d}" for x in xs) + "=", sum(xs))
                         for xs in itertools.product(range(m + 1), repeat=cfg.operands)])
    items = []
    if "+" in cfg.ops:
        items += [item(f"{a:0{width}d}+{b:0{width}d}=", a + b) for a in range(m + 1) for b in range(m + 1)]
    if "-" in cfg.ops:
        items += [item(f"{a:0{width}d}-{b:0{width}d}=", a - b) for a in range(m + 1) for b in range(a + 1)]
    return ItemRows(items)


PEOPLE = [("Tom", "he", "him", "his"), ("Anna", "she", "her", "her"), ("Ben", "he", "him", "his"),
          ("Maria", "she", "her", "her"), ("Sam", "he", "him", "his"), ("Lucy", "she", "her", "her"),
          ("Omar", "he", "him", "his"), ("Mia", "she", "her", "her"), ("Leo", "he", "him", "his"),
          ("Emma", "she", "her", "her"), ("Ravi", "he", "him", "his"), ("Zoe", "she", "her", "her"),
          ("Jack", "he", "him", "his"), ("Nora", "she", "her", "her"), ("Ali", "he", "him", "his"),
          ("Ella", "she", "her", "her"), ("Max", "he", "him", "his"), ("Ivy", "she", "her", "her"),
          ("Noah", "he", "him", "his"), ("Lily", "she", "her", "her")]
THINGS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "cards", "shells", "stamps",
          "balloons", "crayons", "toy cars", "flowers", "buttons", "candies", "eggs", "rocks", "beads", "ribbons"]
HOLDERS = ["bag", "box", "basket", "drawer", "jar"]
START = ["{n} has {x} {t}.", "{n} had {x} {t}.", "There are {x} {t} in {n}'s {h}.", "{n} keeps {x} {t} in a {h}."]
MORE = ["{S} buys {x} more {t}.", "{S} finds {x} more.", "{o} gives {O} {x} {t}.", "Then {s} gets {x} more {t}.",
        "{S} picks up {x} more {t}.", "{o} brings {O} {x} more."]
FEWER = ["{S} gives {x} {t} to {o}.", "{S} sells {x} of them.", "{S} loses {x} {t}.", "{o} takes {x} of them.",
         "Then {s} gives away {x}.", "{S} uses {x} {t}."]
DISTRACT = ["{o} has {x} {u}.", "{o} is {x} years old.", "It takes {x} minutes to walk to school.",
            "{o} buys {x} {u}."]
QUESTION = ["How many {t} does {n} have now?", "How many {t} does {n} have left?", "How many {t} are there now?"]


def word_problems(cfg: TaskSourceConfig) -> ItemRows:
    from astraflow.tasks.sources import Item

    rng = random.Random(f"word_problems-{cfg.seed}")  # Python's generator: 10x faster per draw than numpy's
    items = []
    steps = max(1, cfg.operands - 1)
    top = max(2, cfg.max_operand)
    for _ in range(WORD_PROBLEMS):
        (name, he, him, _his), (other, *_) = rng.sample(PEOPLE, 2)
        things, unrelated = rng.sample(THINGS, 2)
        words = dict(n=name, s=he, S=he.capitalize(), O=him, o=other, t=things, u=unrelated, h=rng.choice(HOLDERS))
        total = rng.randint(1, top)
        story = [rng.choice(START).format(x=total, **words)]
        lines = []
        for _ in range(steps):
            more = total == 0 or rng.random() < 0.5
            x = rng.randint(1, top) if more else rng.randint(1, total)
            story.append(rng.choice(MORE if more else FEWER).format(x=x, **words))
            lines.append(f"{total} {'+' if more else '-'} {x} = {total + x if more else total - x}")
            total = total + x if more else total - x
        if rng.random() < 0.5:  # a number that does not matter
            story.insert(rng.randint(1, len(story)), rng.choice(DISTRACT).format(x=rng.randint(1, top), **words))
        story.append(rng.choice(QUESTION).format(**words))
        solution = "\n".join([*(lines if cfg.worked_solution else []), f"The answer is \\boxed{{{total}}}."])
        items.append(Item(" ".join(story), str(total), solution=solution))
    return ItemRows(items)
