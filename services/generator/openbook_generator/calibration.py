"""The generator's speed measured once, when a model is loaded: the shapes admission plans by.

:func:`measure` runs, after a warm-up request, prefills of 1, 4 and 8 passages of 100 words
and decoding steps of their batches (1, 8 and 32 rows: 1, 2 and 4 beams), each size twice, on
an engine of its own, and returns the median seconds of each size: a busy machine's outliers
must not set the shape. :class:`~openbook_generator.speed.EngineSpeed` fits its shapes to them;
the :class:`~openbook_generator.scheduler.Scheduler` runs this on its decoding thread, between
two pieces of work, so that it measures the thread (and compute threads) that will do the work.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook.types import Passage

# (passages, beams, timed): the warm-up first, then each measured size twice.
_SIZES = [(2, 1, False)] + [(1, 1, True), (4, 2, True), (8, 4, True)] * 2
_QUESTION = "What is measured when the generator starts?"
# Words of the calibration passages (any text of ordinary words would do).
_TEXT = (
    "the council met in the old hall to measure the river and the bridge that the city "
    "had built after the long winter when the harbour froze and the ships waited for "
    "spring while merchants counted grain and the library kept records of every"
)


@dataclass(frozen=True)
class Measurements:
    """Median seconds by size: ``prefills`` (prompt tokens, s), ``steps`` (rows, s)."""

    prefills: list[tuple[float, float]]
    steps: list[tuple[float, float]]


def measure(generator: RagGenerator) -> Measurements:
    """Time ``generator``'s prefills and decoding steps at the sizes of the module docstring,
    on the calling thread. Leaves no calibration passage in its passage cache."""
    prefills: dict[float, list[float]] = {}
    steps: dict[float, list[float]] = {}
    with torch.inference_mode():
        for k, beams, timed in _SIZES:
            passages = _passages(k)
            options = DecodingOptions(num_beams=beams, max_new_tokens=5, min_new_tokens=5)
            shape = generator.request_shape(_QUESTION, passages, options)
            engine = generator.engine()
            started = time.perf_counter()
            engine.add(_QUESTION, passages, options)
            prefill_s = time.perf_counter() - started
            while len(engine):
                rows = engine.rows
                engine.step()
                if timed and engine.last_step_s > 0:
                    steps.setdefault(rows, []).append(engine.last_step_s)
            if timed:
                prefills.setdefault(shape.input_tokens, []).append(prefill_s)
    generator.backend.clear_passage_cache()  # the calibration's passages are nobody's
    return Measurements(_medians(prefills), _medians(steps))


def _medians(samples: dict[float, list[float]]) -> list[tuple[float, float]]:
    return [(size, statistics.median(times)) for size, times in samples.items()]


def _passages(k: int) -> list[Passage]:
    """``k`` passages of 100 words (the paper's passage length), each different."""
    words = _TEXT.split()
    return [
        Passage(
            id=f"calibration-{i}",
            title=f"Record {i}",
            text=" ".join(words[(i + j) % len(words)] for j in range(100)),
            score=0.0,
        )
        for i in range(k)
    ]
