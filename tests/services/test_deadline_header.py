"""A service plans with the earlier of gRPC's deadline and its caller's wall-clock deadline
(``x-openbook-deadline``): a process starved of CPU reads calls late, and gRPC's deadline, a
duration, starts counting only then."""

from __future__ import annotations

import time

import pytest

from openbook.serving.grpc_server import (
    BUDGET_HEADER,
    DEADLINE_HEADER,
    deadline_metadata,
    time_budget,
    time_remaining,
)


class _Context:
    def __init__(self, left: float | None, metadata: tuple = ()) -> None:
        self.left, self.metadata = left, metadata

    def time_remaining(self) -> float | None:
        return self.left

    def invocation_metadata(self):
        return self.metadata


def test_the_caller_s_wall_clock_deadline_wins_when_it_is_earlier():
    read_late = _Context(6.0, deadline_metadata(4.0))  # the call waited 2 s to be read
    assert time_remaining(read_late) == pytest.approx(4.0, abs=0.05)


def test_grpc_s_deadline_wins_when_it_is_earlier():
    assert time_remaining(_Context(2.0, deadline_metadata(9.0))) == pytest.approx(2.0)


def test_a_passed_deadline_leaves_no_time_and_garbage_is_ignored():
    passed = (DEADLINE_HEADER, f"{time.time() - 5:.3f}")
    assert time_remaining(_Context(3.0, (passed,))) == 0.0
    assert time_remaining(_Context(3.0, ((DEADLINE_HEADER, "soon"),))) == 3.0
    assert time_remaining(_Context(3.0, ((DEADLINE_HEADER, "nan"),))) == 3.0


def test_no_deadline_at_all_is_none_and_a_header_alone_is_a_deadline():
    assert time_remaining(_Context(None)) is None
    assert time_remaining(_Context(10 * 365 * 24 * 3600.0)) is None  # gRPC's "none"
    assert time_remaining(_Context(None, deadline_metadata(7.0))) == pytest.approx(7, abs=0.05)


def test_the_budget_is_the_whole_time_the_caller_gave():
    assert time_budget(_Context(2.0, deadline_metadata(4.0))) == pytest.approx(4.0)
    assert time_budget(_Context(2.0)) is None  # a caller that does not say
    for garbage in ("soon", "nan", "inf", "0", "-3"):
        assert time_budget(_Context(2.0, ((BUDGET_HEADER, garbage),))) is None
