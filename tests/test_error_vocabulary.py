"""One error vocabulary in ``openbook/`` (issue 44): a caller's mistake (a request, an argument,
a setting, a configuration file) is an :class:`openbook.errors.InvalidArgument` naming the
field or setting (a ``ValueError`` too, so ``except ValueError`` still holds), which every
boundary maps to INVALID_ARGUMENT / 4xx; a model or index directory that cannot be served is a
declared load error, a ``ValueError`` subclass (:class:`openbook.rag.ModelLoadError`,
``openbook.index.IndexLoadError``); a broken invariant of openbook's own code or state is an
:class:`openbook.errors.InternalError` (INTERNAL, a ``RuntimeError``). No module of the core
raises a bare ``ValueError``: each refusal says which of these it is."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

from openbook.config.redis_endpoint import read_record
from openbook.errors import InternalError, InvalidArgument, status_for
from openbook.index.fusion import Fusion
from openbook.index.join import join_slices
from openbook.index.milvus_engine import milvus_string
from openbook.index.passages import split_passages
from openbook.rag import ModelLoadError
from openbook.rag.adapters import ADAPTER_FILE, AdapterMismatch, LoraSpec, check_base
from openbook.rag.backends import CausalBackend
from openbook.rag.backends.int8_head import Int8Head
from openbook.rag.beam import SearchSettings, new_search
from openbook.rag.confidence import (
    CALIBRATION_FILE,
    LogisticCalibration,
    calibration_from_json,
    confidences,
    load_calibration,
)
from openbook.rag.passage_cache import PassageCache
from openbook.security.secrets import read_secret

CORE = Path(__file__).resolve().parents[1] / "openbook"
MODULES = sorted(str(p.relative_to(CORE)) for p in CORE.rglob("*.py"))


def test_every_module_of_the_core_is_checked():
    # the index package converted first, and the modules this round converted, among them
    assert {
        "index/join.py",
        "index/wal.py",
        "rag/confidence.py",
        "rag/backends/int8_head.py",
        "rag/cache.py",
        "config/redis_endpoint.py",
        "security/secrets.py",
    } <= set(MODULES)


def _bare_value_errors(source: str) -> list[int]:
    """Lines of ``raise ValueError(...)`` and ``raise ValueError``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(raised, ast.Name) and raised.id == "ValueError":
            lines.append(node.lineno)
    return lines


def test_the_check_sees_both_forms():
    assert _bare_value_errors("raise ValueError('x')\nraise ValueError\n") == [1, 2]
    assert _bare_value_errors("raise InvalidArgument('x')\nraise\n") == []


@pytest.mark.parametrize("module", MODULES)
def test_invalid_input_is_an_invalid_argument_not_a_bare_value_error(module):
    bare = _bare_value_errors((CORE / module).read_text())
    assert not bare, (
        f"openbook/{module}: raise InvalidArgument naming the field or setting, a declared "
        f"load error (ModelLoadError, IndexLoadError) for a model or index that cannot be "
        f"served, or InternalError for a broken invariant (lines {bare})"
    )


def test_the_index_entry_points_refuse_with_invalid_argument(tmp_path):
    with pytest.raises(InvalidArgument, match="max_words"):
        split_passages("t", "a b c", max_words=0)
    with pytest.raises(InvalidArgument, match="candidates"):
        Fusion.from_dict({"dense_weight": 1.0, "bm25_weight": 1.0, "candidates": 0})
    with pytest.raises(InvalidArgument, match="num-shards"):
        join_slices(tmp_path / "set", 0)
    with pytest.raises(InvalidArgument, match="missing: shard 0"):
        join_slices(tmp_path / "set", 1)  # nothing built yet
    with pytest.raises(InvalidArgument, match="U\\+0001"):
        milvus_string("a\x01b")
    # still a ValueError for the callers that catch one
    assert issubclass(InvalidArgument, ValueError)


def test_a_wrong_calibration_is_an_invalid_argument_and_its_file_a_model_load_error(tmp_path):
    backwards = {"kind": "piecewise-linear", "x": [0.5, 0.2], "y": [0.0, 1.0]}
    with pytest.raises(InvalidArgument, match=r"x must be strictly increasing: x\[1\]"):
        calibration_from_json(backwards)
    with pytest.raises(InvalidArgument, match="kind must be one of"):
        calibration_from_json({"kind": "isotonic"})
    # the file beside a model: the model cannot be served, naming the file (a ValueError, as
    # the generator's load and the trainer's CLI catch)
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(backwards))
    with pytest.raises(ModelLoadError, match="strictly increasing") as refused:
        load_calibration(tmp_path)
    assert str(tmp_path / CALIBRATION_FILE) in str(refused.value)
    assert isinstance(refused.value, ValueError)
    (tmp_path / CALIBRATION_FILE).write_text('{"kind": "logistic", "bias": NaN}')
    with pytest.raises(ModelLoadError, match="NaN is not a number"):
        load_calibration(tmp_path)
    # a caller that applies a logistic calibration without the answer's features
    logistic = LogisticCalibration(("max_prior",), (1.0,), 0.0)
    with pytest.raises(InvalidArgument, match="^features: "):
        confidences(-1.0, 2, logistic)


def _model_dir(path: Path, weights: bytes) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_an_adapter_that_does_not_match_is_a_model_load_error(tmp_path):
    base = _model_dir(tmp_path / "base", b"these weights")
    other = _model_dir(tmp_path / "other", b"other weights")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / ADAPTER_FILE).write_text(json.dumps({"base_identity": "0" * 64}))
    with pytest.raises(AdapterMismatch) as refused:
        check_base(adapter, other)
    assert isinstance(refused.value, ModelLoadError) and isinstance(refused.value, ValueError)
    (adapter / ADAPTER_FILE).write_text("[]")
    with pytest.raises(ModelLoadError, match="names no base_identity"):
        check_base(adapter, base)
    # the adapter's settings are the caller's: named
    with pytest.raises(InvalidArgument, match="lora rank"):
        LoraSpec(rank=0)
    with pytest.raises(InvalidArgument, match="lora dropout"):
        LoraSpec(dropout=1.0)


def test_the_int8_heads_refusal_is_a_model_load_error():
    # the layer refuses a weight torch's kernel cannot run ...
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        Int8Head(torch.zeros((100, 24)))
    with pytest.raises(InvalidArgument, match=r"\(vocab, width\)"):
        Int8Head(torch.zeros((4, 4, 16)))
    # ... and a model whose head it is cannot be served with an int8 head (a ValueError, as
    # the generator's start and the trust experiment catch)
    head = nn.Linear(24, 100, bias=False)
    model = SimpleNamespace(get_output_embeddings=lambda: head)
    backend = cast(Any, SimpleNamespace(model=model))
    with pytest.raises(ModelLoadError, match="multiple of 16"):
        CausalBackend.quantize_head(backend)
    biased = nn.Linear(16, 100, bias=True)
    model.get_output_embeddings = lambda: biased
    with pytest.raises(ModelLoadError, match="Linear without bias"):
        CausalBackend.quantize_head(backend)


def test_settings_and_configuration_files_are_invalid_arguments(tmp_path):
    with pytest.raises(InvalidArgument, match="passage cache size"):
        PassageCache(-1)
    record = tmp_path / "redis-endpoint.json"
    record.write_text("{}")
    with pytest.raises(InvalidArgument, match="no url"):
        read_record(record)
    with pytest.raises(InvalidArgument, match="OPENBOOK_X_FILE.*cannot read it"):
        read_secret(tmp_path / "missing", "a key (OPENBOOK_X_FILE)")


def test_a_broken_invariant_of_the_decoder_is_internal():
    with pytest.raises(InternalError, match="random generator"):
        new_search(1, SearchSettings(temperature=1.0), torch.device("cpu"))


def test_what_each_kind_answers_over_grpc():
    # why: the generator service declares the load error a client error (ReloadModel names it)
    import openbook_generator.servicer  # noqa: F401

    assert status_for(InternalError("versions must grow")).name == "INTERNAL"
    assert status_for(InvalidArgument("k")).name == "INVALID_ARGUMENT"
    assert status_for(ModelLoadError("corrupt weights")).name == "INVALID_ARGUMENT"
    assert status_for(AdapterMismatch("another base")).name == "INVALID_ARGUMENT"
    assert status_for(ValueError("a library's")).name == "INTERNAL"  # undeclared: a bug
    assert not issubclass(InternalError, ValueError)  # never caught as a client's mistake
