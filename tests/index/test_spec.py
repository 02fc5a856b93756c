"""IndexSpec / AnnParams / BuildOptions: validated once, named in the error, and recoverable
from a built index's manifest."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from openbook.errors import InvalidArgument
from openbook.index import (
    AnnParams,
    BuildOptions,
    IndexSpec,
    Manifest,
    build_index,
    import_embeddings,
    open_index,
)
from openbook.index.manifest import MANIFEST
from openbook.index.request import SearchRequest
from openbook_testkit.index import random_vectors, write_dpr_tsv


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: IndexSpec(name=""), "name"),
        (lambda: IndexSpec(name="  "), "name"),
        (lambda: IndexSpec(name="x", index_type="lsh"), "index_type"),
        (lambda: IndexSpec(name="x", encoder=""), "encoder"),
        (lambda: IndexSpec(name="x", query_encoder=""), "query_encoder"),
        (lambda: IndexSpec(name="x", score_scale=0.0), "score_scale"),
        (lambda: IndexSpec(name="x", score_scale=-1.0), "score_scale"),
        (lambda: IndexSpec(name="x", score_scale=float("nan")), "score_scale"),
        (lambda: IndexSpec(name="x", score_scale=float("inf")), "score_scale"),
        (lambda: IndexSpec(name="x", max_words=0), "max_words"),
        (lambda: IndexSpec(name="x", bm25="yes"), "bm25"),  # type: ignore[arg-type]
        (lambda: IndexSpec(name="x", ann={"hnsw_m": 8}), "ann"),  # type: ignore[arg-type]
        (lambda: AnnParams(hnsw_m=1), "hnsw_m"),
        (lambda: AnnParams(ef_construction=0), "ef_construction"),
        (lambda: AnnParams(ef_search=0), "ef_search"),
        (lambda: AnnParams(hnsw_transform="l2"), "hnsw_transform"),
        (lambda: AnnParams(nlist=0), "nlist"),
        (lambda: AnnParams(pq_m=0), "pq_m"),
        (lambda: AnnParams(nprobe=0), "nprobe"),
        (lambda: AnnParams(rerank=-1), "rerank"),
        (lambda: AnnParams(rerank=1.5), "rerank"),  # type: ignore[arg-type]
        (lambda: AnnParams(coarse_quantizer="ivf"), "coarse_quantizer"),
        (
            lambda: IndexSpec(name="x", index_type="hnsw", ann=AnnParams(coarse_quantizer="hnsw")),
            "coarse_quantizer",
        ),
        (lambda: BuildOptions(batch_size=0), "batch_size"),
        (lambda: BuildOptions(shard_size=0), "shard_size"),
        (lambda: BuildOptions(device=""), "device"),
        (lambda: BuildOptions(precision="int8"), "precision"),
        (lambda: BuildOptions(input_format="csv"), "input_format"),
    ],
)
def test_each_bad_field_is_an_invalid_argument_naming_it(make: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        make()
    assert str(err.value).startswith(field), str(err.value)
    assert isinstance(err.value, ValueError)  # what callers (the CLI, the retriever) catch


def test_specs_are_frozen_and_defaults_are_the_builds() -> None:
    spec = IndexSpec(name="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "y"  # type: ignore[misc]
    assert (spec.index_type, spec.encoder, spec.score_scale, spec.views) == (
        "flat",
        "all-MiniLM-L6-v2",
        None,
        ["dense", "bm25"],
    )
    assert IndexSpec(name="x", bm25=False).views == ["dense"]
    assert IndexSpec(name="x", index_type="bm25", bm25=False).views == ["bm25"]
    assert BuildOptions() == BuildOptions(64, 50_000, None, "auto", True, False, "auto")


# Every index type, with parameters other than the defaults where the type has any.
SPECS = {
    "flat": {"score_scale": 3.0, "max_words": 7},
    "hnsw": {
        "bm25": False,
        "ann": AnnParams(
            hnsw_m=8, ef_construction=40, ef_search=20, hnsw_transform="mips_to_l2", rerank=2
        ),
    },
    "hnsw-sq8": {"ann": AnnParams(hnsw_m=12, ef_search=30)},
    "ivfpq": {"ann": AnnParams(nlist=1, pq_m=4, nprobe=1, rerank=3)},
    "ivfpq-hnsw": {
        "index_type": "ivfpq",
        "ann": AnnParams(
            nlist=1, pq_m=4, nprobe=1, coarse_quantizer="hnsw", hnsw_m=8, ef_search=16
        ),
    },
    "bm25": {"max_words": 12},
}


@pytest.mark.parametrize("case", list(SPECS))
def test_from_manifest_gives_back_the_spec_and_rebuilds_the_same_index(
    case: str, facts_jsonl: Path, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    ctx, question = (str(p.resolve()) for p in dpr_dirs)
    fields = dict(SPECS[case])
    index_type = fields.pop("index_type", case)
    spec = IndexSpec(name=f"facts-{case}", index_type=index_type, **fields)
    if spec.dense:
        spec = dataclasses.replace(spec, encoder=ctx, query_encoder=question)
    quiet = BuildOptions(progress=False, batch_size=8)
    first = build_index([facts_jsonl], tmp_path / "first", spec, quiet)

    again = IndexSpec.from_manifest(first)
    resolved_scale = spec.score_scale or 1.0  # DPR does not normalise: the default is 1
    if index_type == "ivfpq":
        assert again.ann.nlist == 1 and again.ann.pq_m == 4  # as trained
    if spec.dense:
        assert again == dataclasses.replace(spec, score_scale=resolved_scale)
    else:  # a bm25 index records no encoder
        assert dataclasses.replace(again, encoder=spec.encoder) == dataclasses.replace(
            spec, score_scale=resolved_scale
        )
    assert IndexSpec.from_manifest(Manifest.from_file(tmp_path / "first" / MANIFEST)) == again

    second = build_index([facts_jsonl], tmp_path / "second", again, quiet)
    what = ("name", "index_type", "index_params", "encoder", "query_encoder", "dim")
    what += ("score_scale", "max_words", "views", "count", "normalize")
    assert {k: getattr(second, k) for k in what} == {k: getattr(first, k) for k in what}
    with open_index(tmp_path / "first") as a, open_index(tmp_path / "second") as b:
        hits_a = a.search(SearchRequest(["Who wrote Hamlet?"], k=3))[0]
        hits_b = b.search(SearchRequest(["Who wrote Hamlet?"], k=3))[0]
        assert [h.id for h in hits_a] == [h.id for h in hits_b]


def test_an_imported_index_gives_back_its_spec(tmp_path: Path, dpr_dirs: tuple[Path, Path]) -> None:
    import pickle

    n, dim = 12, 32
    rows = [{"id": str(i + 1), "title": f"T{i}", "text": f"passage {i}"} for i in range(n)]
    tsv = write_dpr_tsv(tmp_path / "psgs.tsv", rows)
    vecs = random_vectors(n, dim)
    emb = tmp_path / "emb_0.pkl"
    with open(emb, "wb") as f:
        pickle.dump([(f"wiki:{i + 1}", vecs[i]) for i in range(n)], f)
    question = str(dpr_dirs[1].resolve())
    spec = IndexSpec(name="wiki", encoder="dpr-ctx", query_encoder=question, bm25=False)
    m = import_embeddings(tsv, [emb], tmp_path / "idx", spec, BuildOptions(progress=False))
    assert IndexSpec.from_manifest(m) == dataclasses.replace(spec, score_scale=1.0)
