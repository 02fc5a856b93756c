"""Comparing two answers computed by separate requests.

The retriever encodes queries in batches and the generator decodes in batches, both shaped by
whatever else arrived at the same moment; a matrix product over a different batch can differ in
the last bits of a float32. Two requests for the same answer therefore agree on every id, token
and string exactly, and on every float up to that noise — which is what these compare.
"""

from __future__ import annotations

import math
from typing import Any

# float32 has 24 bits of mantissa (~6e-8): a few ulps of a score, a prior or a log-probability.
REL = 1e-5
ABS = 1e-9


def assert_same_up_to_float_noise(got: Any, want: Any, path: str = "") -> None:
    """``got == want`` for JSON-like values, floats within ``REL``/``ABS`` of each other."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, int | float) and isinstance(want, int | float), (path, got, want)
        assert math.isclose(got, want, rel_tol=REL, abs_tol=ABS), (path, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, got, want)
        for key in want:
            assert_same_up_to_float_noise(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_up_to_float_noise(g, w, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)
