from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from openbook.index import LoadedIndex, build_index, open_index
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.index import make_tiny_dpr_encoders, write_facts

if TYPE_CHECKING:
    from openbook.index.milvus_engine import MilvusEngine


@pytest.fixture(scope="session")
def facts_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_facts(tmp_path_factory.mktemp("facts") / "facts.jsonl")


@pytest.fixture(scope="session")
def facts_index_dir(facts_jsonl: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A flat index over the 30 facts with the real packaged MiniLM (built once per session)."""
    out = tmp_path_factory.mktemp("idx") / "facts"
    build_index([facts_jsonl], out, IndexSpec(name="facts"), BuildOptions(progress=False))
    return out


@pytest.fixture(scope="session")
def facts_index(facts_index_dir: Path) -> Iterator[LoadedIndex]:
    idx = open_index(facts_index_dir)
    yield idx
    idx.close()


@pytest.fixture(scope="session")
def dpr_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(context encoder dir, question encoder dir): tiny random DPR models, 32-d."""
    return make_tiny_dpr_encoders(tmp_path_factory.mktemp("dpr"))


@pytest.fixture(scope="module")
def milvus_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MilvusEngine]:
    """A Milvus Lite engine in this process, one per test module (the Milvus tests)."""
    # why: pymilvus only for the modules that ask (they skip without milvus_lite)
    from openbook.index.milvus_engine import MilvusEngine

    eng = MilvusEngine(str(tmp_path_factory.mktemp("milvus") / "milvus.db"))
    yield eng
    eng.close()
