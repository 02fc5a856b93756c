"""Where a service's torch work may run: one long-lived compute thread, loads in passing threads.

torch's CPU kernels run their parallel regions on OpenMP (GNU libgomp in the torch wheels), which
keeps one pool of worker threads per thread that ever started a parallel region, for as long as
that thread lives. Once the pools hold more threads than the machine has cores, libgomp stops
letting idle workers spin and puts them to sleep at once, so every parallel region pays a
wake-up: on a 2-core machine a (5 x 640) @ (640 x 2048) bf16 product took 105 us from a second
thread instead of 58 us, and a default-stack answer ~40% longer (docs/benchmarks.md).

The main thread never ends, so it must never start a parallel region in a service: loading a model
(whose setup runs forward passes) there would slow every later step of the decoding thread. Loads
go through :func:`in_passing_thread`, whose thread, and with it its OpenMP pool, ends with the
load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T], name: str = "load") -> T:
    """``fn()`` run in a new daemon thread that ends with it: its result, or its exception
    raised here. A signal handler that raises in the calling (main) thread interrupts the wait;
    the daemon thread does not keep the process alive."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
