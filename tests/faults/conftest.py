"""Fixtures of the fault tests: prepared data (built once per session) and whole stacks."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import LocalStack, build_fact_indexes


@pytest.fixture(scope="session")
def prepared_var(tmp_path_factory) -> Path:
    """Indexes facts-a / facts-b and a tiny BART, built once and copied for each stack."""
    var = tmp_path_factory.mktemp("prepared-var")
    build_fact_indexes(var / "indexes")
    make_tiny_bart(var / "models" / "tiny-bart")
    return var


@pytest.fixture(scope="module")
def start_stack(prepared_var, tmp_path_factory) -> Iterator[Callable[..., LocalStack]]:
    """``start_stack(**env)``: the whole system via ``openbook up`` in a fresh var dir."""
    started: list[LocalStack] = []

    def start(**env: str) -> LocalStack:
        var = tmp_path_factory.mktemp("var")
        shutil.copytree(prepared_var, var, dirs_exist_ok=True)
        # One torch thread per service: three model-serving processes share a small (and, on
        # CI, busy) machine; two threads each oversubscribe it and make answers erratic.
        threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        stack = LocalStack(var, extra_env={**threads, **env})
        started.append(stack)
        stack.start()  # returns once the launcher supervises (restarts what dies)
        return stack

    yield start
    for stack in started:
        stack.stop()
