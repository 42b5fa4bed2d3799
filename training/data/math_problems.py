"""Seeded generator of multi-step arithmetic word problems with worked, step-by-step solutions."""

from __future__ import annotations

import math
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


# Corpus v2 kinds. Every step is one "a op b = c" with whole numbers, so the solution checker reads them all.
def _discount(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    pct = r.choice((10, 20, 25, 50))
    price = r.randint(2, 40) * (100 // math.gcd(100, pct))
    off = price * pct // 100
    q = (f"A box of {item} costs {price} dollars at {r.choice(PLACES)}. It is on sale at {pct}% off. "
         f"How much does {name} pay for it?")
    steps = [f"The discount is {price} × {pct} = {price * pct}, and {price * pct} ÷ 100 = {off} dollars.",
             f"{name} pays {price} − {off} = {price - off} dollars."]
    return q, "\n".join(steps), price - off


def _fraction(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    den = r.choice((3, 4, 5, 6, 8))
    num = r.randint(1, den - 1)
    total = den * r.randint(2, 15)
    unit = total // den
    q = (f"{name} has {total} {item} and gives {num}/{den} of them to a friend. "
         f"How many {item} does {name} keep?")
    steps = [f"One {den}th of {total} is {total} ÷ {den} = {unit}.",
             f"{num}/{den} of them is {unit} × {num} = {unit * num}.",
             f"{name} keeps {total} − {unit * num} = {total - unit * num}."]
    return q, "\n".join(steps), total - unit * num


def _equation(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(NAMES)
    x, a, b = r.randint(2, 30), r.randint(2, 9), r.randint(1, 50)
    c = a * x + b
    q = f"{name} thinks of a number, multiplies it by {a} and adds {b}. The result is {c}. What is the number?"
    steps = [f"Undo the addition: {c} − {b} = {c - b}.", f"Undo the multiplication: {c - b} ÷ {a} = {x}."]
    return q, "\n".join(steps), x


def _fence(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(NAMES)
    length, width, cost = r.randint(3, 40), r.randint(2, 30), r.randint(2, 12)
    half = length + width
    q = (f"{name}'s garden is a rectangle {length} meters long and {width} meters wide. Fencing costs {cost} "
         f"dollars per meter. How much does a fence all around the garden cost?")
    steps = [f"Length plus width: {length} + {width} = {half} meters.",
             f"The perimeter is {half} × 2 = {half * 2} meters.",
             f"The fence costs {half * 2} × {cost} = {half * 2 * cost} dollars."]
    return q, "\n".join(steps), half * 2 * cost


def _average(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(NAMES)
    scores = [r.randint(50, 100) for _ in range(3)]
    last = r.randint(52, 100)
    scores.append(last - (sum(scores) + last) % 4)  # a whole average
    steps, run = [], scores[0]
    for s in scores[1:]:
        steps.append(f"{run} + {s} = {run + s}.")
        run += s
    steps.append(f"The average is {run} ÷ 4 = {run // 4}.")
    q = f"{name} scored {', '.join(map(str, scores[:3]))} and {scores[3]} on four tests. What is the average score?"
    return q, "Add the scores: " + "\n".join(steps), run // 4


def _minutes(r: random.Random) -> tuple[str, str, int]:
    name = r.choice(NAMES)
    per = r.choice((5, 6, 10, 12, 15, 20, 30))
    hours = r.randint(1, 6)
    extra = per * r.randint(0, 60 // per - 1)
    total = hours * 60 + extra
    q = (f"{name} spends {hours} hours and {extra} minutes sorting {r.choice(ITEMS)}. Each batch takes {per} "
         f"minutes. How many batches does {name} finish?")
    steps = [f"{hours} hours is {hours} × 60 = {hours * 60} minutes.",
             f"In all: {hours * 60} + {extra} = {total} minutes.",
             f"Batches: {total} ÷ {per} = {total // per}."]
    return q, "\n".join(steps), total // per


def _buses(r: random.Random) -> tuple[str, str, int]:
    a, b = r.sample((4, 6, 8, 9, 10, 12, 14, 15, 16, 18, 20, 24, 25, 30), 2)
    g = math.gcd(a, b)
    q = (f"One bus leaves the station every {a} minutes and another every {b} minutes. They both leave at 8:00. "
         f"After how many minutes do they next leave together?")
    steps = [f"The greatest common divisor of {a} and {b} is {g}.",
             f"The least common multiple is {a} × {b} = {a * b}, divided by the divisor: {a * b} ÷ {g} = "
             f"{a * b // g}."]
    return q, "\n".join(steps), a * b // g


def _savings(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    per, weeks = r.randint(3, 25), r.randint(3, 20)
    saved = per * weeks
    spent = r.randint(1, saved - 1)
    q = (f"{name} saves {per} dollars every week for {weeks} weeks, then spends {spent} dollars on {item}. "
         f"How much money is left?")
    steps = [f"Saved: {per} × {weeks} = {saved} dollars.", f"Left: {saved} − {spent} = {saved - spent} dollars."]
    return q, "\n".join(steps), saved - spent


TEMPLATES: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (
    _buy_sell, _prices, _share, _rate, _ages, _discount, _fraction, _equation, _fence, _average, _minutes, _buses,
    _savings)


def problem(seed: int) -> tuple[str, str]:
    """(question, worked solution ending in 'Answer: N') for one seed."""
    r = random.Random(seed)
    question, steps, answer = r.choice(TEMPLATES)(r)
    return question, f"{steps}\nAnswer: {answer}"
