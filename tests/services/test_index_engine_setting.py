"""OPENBOOK_INDEX_ENGINE and OPENBOOK_MILVUS_URI (issue 41): read and checked by the retriever's
settings, and a retriever asked for an engine it does not serve yet refuses to start instead of
serving (and writing) files."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from openbook.index.engine import EngineKind
from openbook_retriever.server import load
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


def test_a_retriever_refuses_an_engine_it_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENBOOK_INDEX_ENGINE", "milvus")
    monkeypatch.setenv("OPENBOOK_MILVUS_URI", "var/milvus.db")
    with pytest.raises(RuntimeError, match="^OPENBOOK_INDEX_ENGINE=milvus: the retriever serves"):
        load(RetrieverSettings(), None, threading.Event())
