import threading
import time

import pytest

from openbook.errors import Cancelled, DeadlineExceeded, Overloaded
from openbook.serving.batcher import Batcher


def test_concurrent_items_share_a_batch():
    sizes = []

    def double(items):
        sizes.append(len(items))
        return [2 * x for x in items]

    batcher = Batcher(double, max_batch_size=8, max_wait_ms=200)
    results = {}

    def call(x):
        results[x] = batcher.submit(x, timeout_s=5)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    assert results == {i: 2 * i for i in range(8)}
    assert max(sizes) > 1  # batched, not one call per item
    assert sum(sizes) == 8


def test_per_item_error_fails_only_that_item():
    def fn(items):
        return [ValueError(f"bad {x}") if x < 0 else x for x in items]

    batcher = Batcher(fn, max_batch_size=4, max_wait_ms=1)
    assert batcher.submit(3, timeout_s=5) == 3
    with pytest.raises(ValueError, match="bad -1"):
        batcher.submit(-1, timeout_s=5)
    batcher.close()


def test_full_queue_rejects_at_once_and_deadline_is_enforced():
    release = threading.Event()

    def slow(items):
        release.wait(5)
        return items

    batcher = Batcher(slow, max_batch_size=1, max_wait_ms=0, max_queue=1)
    first = threading.Thread(target=lambda: batcher.submit(1, timeout_s=10))
    first.start()
    time.sleep(0.1)  # the worker now holds item 1
    second = threading.Thread(
        target=lambda: pytest.raises(DeadlineExceeded, batcher.submit, 2, 0.3)
    )
    second.start()
    time.sleep(0.1)  # item 2 fills the queue
    with pytest.raises(Overloaded):
        batcher.submit(3, timeout_s=1)
    second.join()
    release.set()
    first.join()
    batcher.close()


def test_expired_items_are_dropped_from_the_batch():
    seen = []
    gate = threading.Event()

    def fn(items):
        if not gate.is_set():
            gate.set()
            time.sleep(0.4)
        seen.extend(items)
        return items

    batcher = Batcher(fn, max_batch_size=1, max_wait_ms=0)
    t = threading.Thread(target=batcher.submit, args=("first", 5))
    t.start()
    time.sleep(0.05)
    with pytest.raises(DeadlineExceeded):
        batcher.submit("late", timeout_s=0.1)
    t.join()
    time.sleep(0.1)
    batcher.close()
    assert "late" not in seen


def test_items_that_do_not_fit_together_lead_the_next_batch():
    batches: list[list[int]] = []
    gate = threading.Event()

    def fn(items):
        gate.wait(10)
        batches.append(list(items))
        return items

    # sum of a batch's items at most 10
    batcher = Batcher(fn, max_batch_size=8, max_wait_ms=50, fits=lambda xs: sum(xs) <= 10)
    threads = [threading.Thread(target=batcher.submit, args=(x, 10)) for x in (1, 6, 5, 4, 7, 3)]
    for t in threads:
        t.start()
        time.sleep(0.01)  # keep the arrival order
    gate.set()
    for t in threads:
        t.join(10)
    batcher.close()
    assert all(sum(b) <= 10 for b in batches)
    assert sorted(x for b in batches for x in b) == [1, 3, 4, 5, 6, 7]
    # first come, first served: a batch is cut where the next item would not fit
    assert [x for b in batches for x in b] == [1, 6, 5, 4, 7, 3]


def test_a_cancelled_item_frees_its_place_and_a_running_one_sees_gave_up():
    started, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def fn(items, gave_up):
        started.set()
        release.wait(10)
        seen.extend(check() for check in gave_up)
        return items

    batcher = Batcher(fn, max_batch_size=1, max_wait_ms=0, max_queue=1, pass_gave_up=True)
    cancel_running: list = []
    cancel_queued: list = []
    running = threading.Thread(
        target=lambda: pytest.raises(
            Cancelled, batcher.submit, "a", 10, on_cancel=cancel_running.append
        )
    )
    running.start()
    assert started.wait(10)
    queued = threading.Thread(
        target=lambda: pytest.raises(
            Cancelled, batcher.submit, "b", 10, on_cancel=cancel_queued.append
        )
    )
    queued.start()
    _until(lambda: batcher.depth() == 1)
    with pytest.raises(Overloaded):
        batcher.submit("c", timeout_s=1)  # the line is full
    cancel_queued[0]()
    assert batcher.depth() == 0  # its place is free at once
    queued.join(10)
    cancel_running[0]()
    running.join(10)
    release.set()
    assert batcher.submit("d", timeout_s=10) == "d"
    batcher.close()
    assert seen[0] is True  # the running batch was told its caller gave up


def _until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.005)
