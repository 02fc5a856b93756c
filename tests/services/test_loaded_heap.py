"""A service freezes what it loaded out of the garbage collector's walks before it serves
(openbook/runtime/heap.py): no request pays for a full collection over torch, transformers and
the model; what requests allocate is collected as before."""

from __future__ import annotations

import gc
import threading
import weakref

from openbook.runtime.heap import freeze_loaded_heap
from openbook.serving.grpc_server import GrpcService


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_frozen_heap_is_skipped_and_new_garbage_still_collected():
    try:
        freeze_loaded_heap()
        assert gc.get_freeze_count() > 0
        made_after = _cycle()  # a request's cyclic garbage
        gc.collect()
        assert made_after() is None
    finally:
        gc.unfreeze()


def test_a_service_freezes_what_it_loaded_before_it_serves():
    service = GrpcService("svc", "127.0.0.1", 0, lambda server: None, access_log=False)
    stop = threading.Event()
    frozen_during_load: list[int] = []

    def load() -> None:
        frozen_during_load.append(gc.get_freeze_count())
        stop.set()

    gc.unfreeze()
    try:
        service.run_until_signal(load, stop)  # on the main thread, as a service's process runs it
        assert frozen_during_load == [0]
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
