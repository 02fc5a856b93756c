"""Services start no torch work on their main thread: the initial load and the generator's
reloads run in threads that end with them (openbook/serving/threads.py: libgomp keeps an OpenMP
pool per thread that ever computed, and more pooled threads than cores slow every parallel
region of the decoding thread)."""

from __future__ import annotations

import threading

import pytest
from checkpoints_kit import tiny_checkpoint

from openbook.rag import RagGenerator
from openbook.serving.grpc_server import GrpcService
from openbook.serving.threads import in_passing_thread
from openbook_testkit.rag import make_tiny_bart


def test_in_passing_thread_returns_from_a_thread_that_has_ended():
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert in_passing_thread(work) == 42
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_in_passing_thread_raises_the_load_s_own_exception():
    class Broken(Exception):
        pass

    error = Broken("no such model")

    def work() -> None:
        raise error

    with pytest.raises(Broken) as raised:
        in_passing_thread(work)
    assert raised.value is error


def test_a_service_loads_off_the_thread_that_runs_it():
    service = GrpcService("svc", "127.0.0.1", 0, lambda server: None, access_log=False)
    stop = threading.Event()
    loaders: list[threading.Thread] = []

    def load() -> None:
        loaders.append(threading.current_thread())
        stop.set()

    service.run_until_signal(load, stop)
    assert loaders and loaders[0] is not threading.current_thread()
    assert not loaders[0].is_alive()


def test_a_generator_reload_loads_in_a_passing_thread(tmp_path, monkeypatch):
    import openbook_generator.servicer as servicer_module

    bart = make_tiny_bart(tmp_path / "bart")
    tiny_checkpoint(tmp_path / "checkpoints", 1, bart)
    loaders: list[threading.Thread] = []
    original = servicer_module.load_generator

    def recording(*args, **kwargs):
        loaders.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(servicer_module, "load_generator", recording)
    servicer = servicer_module.GeneratorServicer(
        RagGenerator.load(bart), checkpoint_root=tmp_path / "checkpoints", base_model=bart
    )
    try:
        assert servicer.load_checkpoint("step-000001") == "step-000001"
    finally:
        servicer.close()
    assert loaders and loaders[0] is not threading.current_thread()
    assert not loaders[0].is_alive()


def test_the_decoding_thread_resizes_between_layers_not_only_between_pieces(tmp_path, monkeypatch):
    """A piece of work a neighbour stalls may take seconds: the decoding thread re-reads the
    CPU budget from a hook on every layer of its forward passes
    (openbook/runtime/compute_threads.py), and only the decoding thread does."""
    from openbook.runtime.compute_threads import ComputeThreads, ComputeThreadsOptions
    from openbook.runtime.cpu_budget import CpuBudget
    from openbook_generator.scheduler import Scheduler, SchedulingOptions
    from openbook_testkit.rag import make_tiny_causal_lm

    class OneCpu(CpuBudget):
        def usable(self) -> int:
            return 1

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    generator = RagGenerator.load(make_tiny_causal_lm(tmp_path / "gemma"), dtype="float32")
    applied_on: list[str] = []
    compute = ComputeThreads(
        ComputeThreadsOptions(interval_s=0.0),  # every call re-reads the budget
        budget=OneCpu(),
        set_threads=lambda n: applied_on.append(threading.current_thread().name),
    )
    scheduler = Scheduler(
        lambda: generator, SchedulingOptions(), fits=lambda shapes: True, compute=compute
    )
    try:
        scheduler.calibrate(generator)  # one job of ~40 pieces of work, 2 layers each
    finally:
        scheduler.close()
    assert set(applied_on) == {"generate-scheduler"}
    assert len(applied_on) > 40  # more than once per turn of the thread
