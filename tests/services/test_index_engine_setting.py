"""OPENBOOK_INDEX_ENGINE and OPENBOOK_MILVUS_URI (issue 41): read and checked by the retriever's
settings, and the retriever opens the registry of the engine asked for (serving from Milvus:
tests/services/test_milvus_serving.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from openbook.index.engine import EngineKind
from openbook_retriever.milvus_registry import MilvusRegistry
from openbook_retriever.registry import IndexRegistry
from openbook_retriever.server import open_registry
from openbook_retriever.settings import RetrieverSettings


def test_the_engine_settings_are_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBOOK_INDEX_ENGINE", raising=False)
    monkeypatch.delenv("OPENBOOK_MILVUS_URI", raising=False)
    assert RetrieverSettings().index_engine is EngineKind.FILES
    monkeypatch.setenv("OPENBOOK_INDEX_ENGINE", "milvus")
    monkeypatch.setenv("OPENBOOK_MILVUS_URI", "http://milvus:19530")
    settings = RetrieverSettings()
    assert settings.index_engine is EngineKind.MILVUS
    assert settings.milvus_uri == "http://milvus:19530"
    monkeypatch.setenv("OPENBOOK_MILVUS_URI", "var/milvus")  # Milvus Lite needs a .db path
    with pytest.raises(ValidationError, match="OPENBOOK_MILVUS_URI: expected"):
        RetrieverSettings()
    monkeypatch.setenv("OPENBOOK_MILVUS_URI", "var/milvus.db")
    monkeypatch.setenv("OPENBOOK_INDEX_ENGINE", "elastic")
    with pytest.raises(ValidationError, match="'files' or 'milvus'"):
        RetrieverSettings()


def test_the_retriever_opens_the_configured_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("OPENBOOK_INDEX_ENGINE", raising=False)
    files = open_registry(RetrieverSettings(index_root=tmp_path / "indexes"))
    assert isinstance(files, IndexRegistry)
    monkeypatch.setenv("OPENBOOK_INDEX_ENGINE", "milvus")
    monkeypatch.setenv("OPENBOOK_MILVUS_URI", str(tmp_path / "milvus.db"))
    milvus = open_registry(RetrieverSettings(index_root=tmp_path / "indexes"))
    assert isinstance(milvus, MilvusRegistry) and milvus.available() == []
    assert not (tmp_path / "indexes").exists()  # the engine holds the indexes
