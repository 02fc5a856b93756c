import threading
import time

import pytest

from openbook.errors import DeadlineExceeded, Overloaded
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
