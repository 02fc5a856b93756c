"""Training pairs and a deterministic, resumable batch order."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from openbook_trainer.evaluation.data import DataError, Example, read_examples

__all__ = [
    "DataError",
    "Example",
    "TrainPair",
    "batch_at",
    "batches_per_epoch",
    "read_examples",
    "training_pairs",
]


@dataclass(frozen=True)
class TrainPair:
    question: str
    target: str


def training_pairs(examples: Sequence[Example], answers: str = "first") -> list[TrainPair]:
    """One (input, target) pair per example, or per gold answer with ``answers="all"``."""
    if answers == "first":
        return [TrainPair(e.question, e.answers[0]) for e in examples]
    return [TrainPair(e.question, a) for e in examples for a in e.answers]


def batches_per_epoch(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


@lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return tuple(order)


def batch_at(
    pairs: Sequence[TrainPair], cursor: int, batch_size: int, seed: int
) -> list[TrainPair]:
    """The ``cursor``-th micro-batch of the whole run.

    Every epoch is a fresh shuffle seeded by (seed, epoch), so the batch sequence depends only on
    the cursor and a resumed run sees exactly the batches an uninterrupted one would have.
    """
    per_epoch = batches_per_epoch(len(pairs), batch_size)
    epoch, pos = divmod(cursor, per_epoch)
    order = _epoch_order(len(pairs), seed, epoch)
    return [pairs[i] for i in order[pos * batch_size : (pos + 1) * batch_size]]
