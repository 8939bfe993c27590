"""`search_facts`: a generated encyclopedia of fictional people and towns, and questions about
it that only a search can answer (names and numbers are drawn at random, so no fact can be
guessed or learnt from another).

One document per entity:
- a town: "Varnholt is a town on the river Elm. Varnholt was founded in 1342 and has 48 bridges."
- a person: "Tom Ashby is a baker. Tom Ashby lives in Varnholt and is 34 years old."

Questions take one search ("How old is Tom Ashby?": search "Tom Ashby", read 34) or, with
`hops: 2`, also two ("In what year was the town where Tom Ashby lives founded?": search
"Tom Ashby", read Varnholt, search "Varnholt", read 1342). A row carries the searches that
find its evidence, in order (`queries`): the supervised warm-up's path to the answer.

Seeded and finite: `entities` people and a quarter as many towns (at least 2), three
one-hop questions about each entity and, with `hops: 2`, three two-hop questions per person.
The corpus is a pure function of the config, so the trainer's warm-up and every worker build
the same index (`environments/retrieval.py`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from astraflow.config.loader import ConfigError
from astraflow.config.schema import TaskSourceConfig
from astraflow.tasks.generators import ItemRows

if TYPE_CHECKING:
    from astraflow.tasks.sources import Item

FIRST = ["Tom", "Anna", "Ben", "Maria", "Sam", "Lucy", "Omar", "Mia", "Leo", "Emma", "Ravi", "Zoe", "Jack", "Nora",
         "Ali", "Ella", "Max", "Ivy", "Noah", "Lily", "Hugo", "Rosa", "Finn", "Cleo", "Amir", "Tess", "Owen", "Yara",
         "Liam", "Jade"]
LAST = ["Ashby", "Pell", "Morrow", "Quint", "Harlow", "Dunn", "Fenwick", "Garrick", "Holt", "Ives", "Keane",
        "Lister", "Marsh", "Nolan", "Oakes", "Prior", "Rudd", "Sallow", "Thorne", "Voss", "Wren", "Yates", "Brook",
        "Crane", "Dale", "Ember", "Frost", "Grey", "Hale", "Lowe"]
TOWN_HEAD = ["Varn", "Dor", "Kel", "Mar", "Ost", "Bel", "Tarn", "Wick", "Ash", "Brom", "Cald", "Eld", "Fen", "Gil",
             "Hav", "Lun", "Nor", "Pem", "Rav", "Sel"]
TOWN_TAIL = ["holt", "sk", "ford", "mere", "wick", "by", "ham", "ton", "stead", "well"]
JOBS = ["baker", "nurse", "teacher", "farmer", "painter", "tailor", "miner", "sailor", "judge", "doctor", "weaver",
        "potter"]
RIVERS = ["Elm", "Tay", "Oder", "Lune", "Ash", "Wye", "Dove", "Nene", "Test", "Exe"]


@dataclass(frozen=True)
class Town:
    name: str
    river: str
    founded: int
    bridges: int

    def document(self) -> str:
        return (f"{self.name} is a town on the river {self.river}. {self.name} was founded in {self.founded} "
                f"and has {self.bridges} bridges.")


@dataclass(frozen=True)
class Person:
    name: str
    job: str
    town: Town
    age: int

    def document(self) -> str:
        return f"{self.name} is a {self.job}. {self.name} lives in {self.town.name} and is {self.age} years old."


def world(cfg: TaskSourceConfig) -> tuple[list[Town], list[Person]]:
    """The towns and people of this config's encyclopedia."""
    rng = random.Random(f"search_facts-{cfg.seed}")
    n_people = max(1, cfg.entities)
    n_towns = max(2, n_people // 4)
    if n_people > len(FIRST) * len(LAST) or n_towns > len(TOWN_HEAD) * len(TOWN_TAIL):
        raise ConfigError(f"tasks.entities: expected at most {len(FIRST) * len(LAST)} people, got {n_people}")
    town_names = rng.sample([h + t for h in TOWN_HEAD for t in TOWN_TAIL], n_towns)
    towns = [Town(n, rng.choice(RIVERS), rng.randint(1100, 1899), rng.randint(2, 60)) for n in town_names]
    people = [Person(f"{first} {last}", rng.choice(JOBS), rng.choice(towns), rng.randint(18, 90))
              for first, last in rng.sample([(f, s) for f in FIRST for s in LAST], n_people)]
    return towns, people


def documents(cfg: TaskSourceConfig) -> list[str]:
    towns, people = world(cfg)
    return [t.document() for t in towns] + [p.document() for p in people]


def _questions(towns: list[Town], people: list[Person], hops: int) -> list[tuple[str, str, tuple[str, ...]]]:
    """(question, answer, the searches that find the evidence) for every entity."""
    out = []
    for t in towns:
        out += [(f"In what year was {t.name} founded?", str(t.founded), (t.name,)),
                (f"Which river runs through {t.name}?", t.river, (t.name,)),
                (f"How many bridges does {t.name} have?", str(t.bridges), (t.name,))]
    for p in people:
        out += [(f"How old is {p.name}?", str(p.age), (p.name,)),
                (f"What does {p.name} do for a living?", p.job, (p.name,)),
                (f"In which town does {p.name} live?", p.town.name, (p.name,))]
        if hops >= 2:
            path = (p.name, p.town.name)
            out += [(f"In what year was the town where {p.name} lives founded?", str(p.town.founded), path),
                    (f"Which river runs through the town where {p.name} lives?", p.town.river, path),
                    (f"How many bridges does the town where {p.name} lives have?", str(p.town.bridges), path)]
    return out


def search_facts(cfg: TaskSourceConfig) -> ItemRows:
    from astraflow.tasks.sources import Item

    towns, people = world(cfg)
    return ItemRows([Item(question, answer, row={"queries": list(queries)})
                     for question, answer, queries in _questions(towns, people, cfg.hops)])
