"""Seeded generator of multi-step arithmetic word problems with worked, step-by-step solutions."""

from __future__ import annotations

import random
from collections.abc import Callable

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kemal", "Lena",
         "Mina", "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yara", "Zoe")
ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards", "eggs",
         "bottles", "tickets", "plants", "bricks", "coins")
PLACES = ("the market", "the library", "school", "the fair", "the shop", "the garden", "the warehouse")


def _buy_sell(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    per, boxes = r.randint(3, 24), r.randint(2, 12)
    total = per * boxes
    sold = r.randint(1, total // 2)
    given = r.randint(1, max(1, (total - sold) // 2))
    left = total - sold - given
    q = (f"{name} has {boxes} boxes with {per} {item} in each box. {name} sells {sold} {item} at "
         f"{r.choice(PLACES)} and gives {given} to a friend. How many {item} does {name} have left?")
    steps = [f"{name} starts with {boxes} × {per} = {total} {item}.",
             f"After selling {sold}: {total} − {sold} = {total - sold}.",
             f"After giving away {given}: {total - sold} − {given} = {left}."]
    return q, "\n".join(steps), left


def _prices(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(NAMES)
    a_item, b_item = r.sample(ITEMS, 2)
    a_n, a_p, b_n, b_p = r.randint(2, 9), r.randint(2, 15), r.randint(2, 9), r.randint(2, 15)
    cost = a_n * a_p + b_n * b_p
    paid = (cost // 10 + r.randint(1, 5)) * 10
    q = (f"{name} buys {a_n} {a_item} at {a_p} dollars each and {b_n} {b_item} at {b_p} dollars each, "
         f"and pays with {paid} dollars. How much change does {name} get?")
    steps = [f"The {a_item} cost {a_n} × {a_p} = {a_n * a_p} dollars.",
             f"The {b_item} cost {b_n} × {b_p} = {b_n * b_p} dollars.",
             f"Together: {a_n * a_p} + {b_n * b_p} = {cost} dollars.",
             f"Change: {paid} − {cost} = {paid - cost} dollars."]
    return q, "\n".join(steps), paid - cost


def _share(r: random.Random) -> tuple[str, str, int]:
    names = r.sample(NAMES, 3)
    item = r.choice(ITEMS)
    each, kids = r.randint(2, 20), r.randint(2, 9)
    total = each * kids
    extra = r.randint(1, total - 1)
    q = (f"{names[0]} collects {total - extra} {item} and {names[1]} adds {extra} more. They share all of them "
         f"equally among {kids} children, including {names[2]}. How many {item} does each child get?")
    steps = [f"In total there are {total - extra} + {extra} = {total} {item}.",
             f"Each child gets {total} ÷ {kids} = {each}."]
    return q, "\n".join(steps), each


def _rate(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(NAMES)
    speed, hours, minutes = r.randint(3, 60), r.randint(2, 8), r.choice((30, 60, 120))
    extra = r.randint(3, 45) * (2 if minutes == 30 else 1)  # whole parts in half an hour
    per_min_extra = extra * minutes // 60
    first = speed * hours
    total = first + per_min_extra
    q = (f"A machine run by {name} makes {speed} parts per hour for {hours} hours, then a faster machine makes "
         f"{extra} parts per hour for {minutes} minutes. How many parts are made in total?")
    steps = [f"The first machine makes {speed} × {hours} = {first} parts.",
             f"{minutes} minutes is {minutes / 60:g} hours, so the second makes {extra} × {minutes / 60:g} = "
             f"{per_min_extra} parts.",
             f"In total: {first} + {per_min_extra} = {total} parts."]
    return q, "\n".join(steps), total


def _ages(r: random.Random) -> tuple[str, str, int]:
    a, b = r.sample(NAMES, 2)
    age_b, diff, years = r.randint(3, 40), r.randint(2, 30), r.randint(2, 15)
    age_a = age_b + diff
    q = (f"{a} is {diff} years older than {b}. {b} is {age_b} years old. How old will {a} be in "
         f"{years} years?")
    steps = [f"{a} is now {age_b} + {diff} = {age_a} years old.",
             f"In {years} years {a} will be {age_a} + {years} = {age_a + years}."]
    return q, "\n".join(steps), age_a + years


TEMPLATES: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (_buy_sell, _prices, _share, _rate, _ages)


def problem(seed: int) -> tuple[str, str]:
    """(question, worked solution ending in 'Answer: N') for one seed."""
    r = random.Random(seed)
    question, steps, answer = r.choice(TEMPLATES)(r)
    return question, f"{steps}\nAnswer: {answer}"
