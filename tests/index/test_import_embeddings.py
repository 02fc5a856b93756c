"""`openbook index import`: DPR's psgs_w100.tsv + precomputed vectors -> index, no encoding.

Inputs are written in exactly the published layouts: DPR's pickled lists of (id, vector)
tuples and wiki_dpr's Parquet / Arrow tables with an ``embeddings`` list<float32> column.
"""

from __future__ import annotations

import json
import pickle
import weakref
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from openbook.index import importer as importer_mod
from openbook.index import open_index, stages
from openbook.index.cli import app
from openbook.index.embedding_files import EmbeddingsError, iter_embeddings, natural_order
from openbook.index.importer import import_embeddings
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.index import random_vectors, write_dpr_tsv

N, DIM = 30, 32  # DIM: the tiny DPR question encoder's
DOC_ENCODER = "facebook/dpr-ctx_encoder-multiset-base"
runner = CliRunner()


def _rows(n: int = N) -> list[dict[str, str]]:
    words = ["tower", "paris", "mountain", "earth", "python", "moon", "planet", "hamlet"]
    return [
        {"id": str(i + 1), "title": f"Title {i}", "text": " ".join(words[i % 7 : i % 7 + 4])}
        for i in range(n)
    ]


def _vectors(n: int = N, dim: int = DIM) -> np.ndarray:
    return random_vectors(n, dim, seed=3, normalize=True)  # own vector ranks itself first


def _write_pickles(
    out: Path, entries: list[tuple], shards: int = 3, stem: str = "wikipedia_passages"
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, part in enumerate(np.array_split(np.arange(len(entries)), shards)):
        p = out / f"{stem}_{i}.pkl"
        with open(p, "wb") as f:
            pickle.dump([entries[j] for j in part], f)
        paths.append(p)
    return paths


def _entries(vecs: np.ndarray, prefix: str = "wiki:") -> list[tuple]:
    return [(f"{prefix}{i + 1}", vecs[i]) for i in range(len(vecs))]


def _table(vecs: np.ndarray, rows: list[dict[str, str]]) -> pa.Table:
    return pa.table(
        {
            "id": [r["id"] for r in rows],
            "text": [r["text"] for r in rows],
            "title": [r["title"] for r in rows],
            "embeddings": pa.array([v.tolist() for v in vecs], type=pa.list_(pa.float32())),
        }
    )


@pytest.fixture()
def tsv(tmp_path: Path) -> Path:
    return write_dpr_tsv(tmp_path / "psgs_w100.tsv", _rows())


OPTIONS = BuildOptions(shard_size=10, batch_size=4, progress=False)


def _spec(qenc: Path | str, index_type: str = "flat") -> IndexSpec:
    return IndexSpec(
        name="wiki", index_type=index_type, encoder=DOC_ENCODER, query_encoder=str(qenc)
    )


def _assert_searchable(out: Path, vecs: np.ndarray) -> None:
    r = runner.invoke(app, ["info", str(out), "--verify"])
    assert r.exit_code == 0, r.output
    with open_index(out) as idx:
        assert idx.manifest.count == N and idx.manifest.dim == vecs.shape[1]
        np.testing.assert_array_equal(idx.get_vectors(range(N)), vecs)
        for row in (0, 13, N - 1):
            hits = idx.search(SearchRequest(k=3, query_vectors=vecs[row]))[0]
            assert hits[0].id == str(row + 1)
            assert hits[0].title == f"Title {row}"
            assert hits[0].score == pytest.approx(1.0, abs=1e-5)  # score_scale 1, unit vectors


def test_import_dpr_pickle_shards(tsv: Path, tmp_path: Path, dpr_dirs: tuple[Path, Path]) -> None:
    vecs = _vectors()
    files = _write_pickles(tmp_path / "emb", _entries(vecs))
    out = tmp_path / "idx"
    m = import_embeddings(tsv, files, out, _spec(dpr_dirs[1]), OPTIONS)
    assert m.encoder == DOC_ENCODER  # a hub name is recorded as given
    assert m.query_encoder == str(dpr_dirs[1].resolve())
    assert (m.score_scale, m.normalize, m.index_type) == (1.0, False, "flat")
    _assert_searchable(out, vecs)
    with open_index(out) as idx:
        assert idx.query_encoder.dim == DIM  # the retriever can load what was recorded
        # The passages get a bm25 view too, as a build's do; DPR's vectors keep the paper's
        # dense retrieval as the default, hybrid on request.
        assert m.views == ["dense", "bm25"] and idx.default_retrieval == "dense"
        (bm25,) = idx.search(SearchRequest(["python moon planet hamlet"], k=3, retrieval="bm25"))
        assert bm25[0].text == "python moon planet hamlet"
        (hybrid,) = idx.search(
            SearchRequest(["python moon planet hamlet"], k=3, retrieval="hybrid")
        )
        scores = [p.score for p in hybrid]  # random vectors: the dense part decides the order
        assert len(hybrid) == 3 and scores == sorted(scores, reverse=True)
    assert not (tmp_path / ".idx.partial").exists()


def test_import_parquet_hnsw_plain_ids(tsv: Path, tmp_path: Path) -> None:
    vecs = _vectors()
    pq.write_table(_table(vecs, _rows()), tmp_path / "train-0.parquet", row_group_size=7)
    out = tmp_path / "idx"
    # a query encoder that only exists where the retriever runs is recorded as given
    spec = _spec("/models/dpr-question_encoder-multiset-base", index_type="hnsw")
    m = import_embeddings(tsv, [tmp_path / "train-0.parquet"], out, spec, OPTIONS)
    assert m.query_encoder == "/models/dpr-question_encoder-multiset-base"
    assert m.index_params["metric"] == "inner_product"
    _assert_searchable(out, vecs)


def test_wiki_dpr_parquet_carries_its_own_passages(tmp_path: Path) -> None:
    """wiki_dpr has id/title/text next to the vectors: no psgs_w100.tsv needed."""
    vecs = _vectors()
    files = []
    for i, (a, b) in enumerate(((0, 12), (12, N))):
        files.append(tmp_path / f"train-{i:05d}-of-00002.parquet")
        pq.write_table(_table(vecs[a:b], _rows()[a:b]), files[-1], row_group_size=5)
    out = tmp_path / "idx"
    m = import_embeddings(None, files, out, _spec("/models/q"), OPTIONS)
    assert m.input_format == "embeddings"
    _assert_searchable(out, vecs)

    pickles = _write_pickles(tmp_path / "emb", _entries(vecs))
    with pytest.raises(EmbeddingsError, match="_0.pkl: DPR's pickles hold no passage text"):
        import_embeddings(None, pickles, tmp_path / "idx2", _spec("/models/q"), OPTIONS)
    assert not list(tmp_path.glob(".idx2*")) and not (tmp_path / "idx2").exists()


def test_import_arrow_stream_over_two_files(tsv: Path, tmp_path: Path) -> None:
    vecs, rows = _vectors(), _rows()
    paths = []
    for i, (a, b) in enumerate(((0, 17), (17, N))):
        table = _table(vecs[a:b], rows[a:b])
        p = tmp_path / f"wiki_dpr-train-{i:05d}-of-00002.arrow"
        with pa.OSFile(str(p), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=5):
                w.write_batch(batch)
        paths.append(p)
    out = tmp_path / "idx"
    import_embeddings(tsv, paths[::-1], out, _spec("/models/q"), OPTIONS)  # natural order restored
    _assert_searchable(out, vecs)


def test_cli_import_orders_shards_naturally(tsv: Path, tmp_path: Path) -> None:
    vecs = _vectors()
    files = _write_pickles(tmp_path / "emb", _entries(vecs, prefix=""), shards=12)
    shell_glob = sorted(str(p) for p in files)  # _0, _1, _10, _11, _2: not the passages' order
    assert shell_glob[2].endswith("_10.pkl")
    out = tmp_path / "idx"
    args = ["import", *shell_glob, "-p", str(tsv), "--name", "wiki", "--out", str(out)]
    args += ["--doc-encoder", DOC_ENCODER, "--query-encoder", "/models/q", "--no-progress"]
    r = runner.invoke(app, [*args, "--shard-size", "7", "--batch-size", "2"])
    assert r.exit_code == 0, r.output
    assert "imported index 'wiki' (flat, 30 passages, dim 32)" in r.output
    _assert_searchable(out, vecs)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["encoder"] == DOC_ENCODER and manifest["query_encoder"] == "/models/q"

    r = runner.invoke(app, args)  # exists already
    assert r.exit_code == 2 and "already exists" in r.output


class Boom(RuntimeError):
    pass


def test_resume_after_interruption(
    tsv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vecs = _vectors()
    files = _write_pickles(tmp_path / "emb", _entries(vecs))
    out, partial = tmp_path / "idx", tmp_path / ".idx.partial"
    real_iter = importer_mod.iter_embeddings

    def interrupted(*a, **k):  # type: ignore[no-untyped-def]
        for n, batch in enumerate(real_iter(*a, **k)):
            if n == 6:  # 24 vectors read: shards 0 and 1 (rows 0..19) are on disk
                raise Boom("interrupted")
            yield batch

    monkeypatch.setattr(importer_mod, "iter_embeddings", interrupted)
    with pytest.raises(Boom):
        import_embeddings(tsv, files, out, _spec("/models/q"), OPTIONS)
    assert not out.exists()  # nothing where a service would load it
    shards = partial / "_build" / "shards"
    assert sorted(p.name for p in shards.glob("shard-*.npy")) == [
        "shard-00000.npy",
        "shard-00001.npy",
    ]
    shard1 = shards / "shard-00001.npy"
    shard1.write_bytes(shard1.read_bytes()[:-8])  # a damaged shard is redone, not trusted

    written: list[str] = []
    real_save = np.save

    def save(path, arr, *a, **k):  # type: ignore[no-untyped-def]
        written.append(Path(path).name)
        return real_save(path, arr, *a, **k)

    monkeypatch.setattr(importer_mod, "iter_embeddings", real_iter)
    monkeypatch.setattr(stages.np, "save", save)
    import_embeddings(tsv, files, out, _spec("/models/q"), OPTIONS)
    written = [w for w in written if w.startswith("shard-")]  # not the bm25 view's files
    assert written == ["shard-00001.tmp.npy", "shard-00002.tmp.npy"]  # shard 0 reused
    assert not partial.exists()
    _assert_searchable(out, vecs)


def _bad_import(tsv: Path, files: list[Path], tmp_path: Path, match: str) -> None:
    out = tmp_path / "idx"
    with pytest.raises(EmbeddingsError, match=match):
        import_embeddings(tsv, files, out, _spec("/models/q"), OPTIONS)
    assert not out.exists()
    assert not (tmp_path / ".idx.partial").exists()
    assert not list(tmp_path.glob(".idx.*"))  # no lock file either


def test_id_not_in_passages(tsv: Path, tmp_path: Path) -> None:
    entries = _entries(_vectors())
    entries[11] = ("wiki:999", entries[11][1])
    files = _write_pickles(tmp_path / "emb", entries)
    _bad_import(
        tsv,
        files,
        tmp_path,
        r"wikipedia_passages_1.pkl: entry 1 \(id 'wiki:999'\) "
        r"is not a passage id in .*psgs_w100.tsv",
    )


def test_passage_without_vector(tsv: Path, tmp_path: Path) -> None:
    entries = _entries(_vectors())
    del entries[5]
    files = _write_pickles(tmp_path / "emb", entries)
    _bad_import(tsv, files, tmp_path, r"psgs_w100.tsv: passage '6' \(row 5\) has no vector")

    entries = _entries(_vectors())[:-1]  # the last passage has none
    files = _write_pickles(tmp_path / "emb", entries)
    _bad_import(
        tsv,
        files,
        tmp_path,
        r"has 30 passages but the embeddings end after 29 "
        r"vectors: passage '30' \(row 29\)",
    )


def test_more_vectors_than_passages(tsv: Path, tmp_path: Path) -> None:
    entries = _entries(_vectors())
    files = _write_pickles(tmp_path / "emb", [*entries, entries[3]])
    _bad_import(tsv, files, tmp_path, r"_2.pkl: entry 9 \(id 'wiki:4'\): more vectors than the 30")


def test_mixed_dimensions(tsv: Path, tmp_path: Path) -> None:
    entries = _entries(_vectors())
    entries[4] = (entries[4][0], entries[4][1][:16])
    files = _write_pickles(tmp_path / "emb", entries)
    _bad_import(tsv, files, tmp_path, r"_0.pkl: entry 4 \(id 'wiki:5'\) has dim 16, expected 32")

    entries = _entries(_vectors())
    entries[20:] = [(i, v[:16]) for i, v in entries[20:]]  # the whole last file
    files = _write_pickles(tmp_path / "emb", entries)
    _bad_import(tsv, files, tmp_path, r"_2.pkl: entry 0 has dim 16, but .*_0.pkl has dim 32")


def test_non_finite_vector(tmp_path: Path) -> None:
    vecs = _vectors()
    vecs[17, 3] = np.nan
    pq.write_table(_table(vecs, _rows()), tmp_path / "t.parquet")
    out = tmp_path / "idx"
    with pytest.raises(EmbeddingsError, match=r"t.parquet: entry 17 \(id '18'\) has non-finite"):
        import_embeddings(None, [tmp_path / "t.parquet"], out, _spec("/models/q"), OPTIONS)
    assert not list(tmp_path.glob(".idx*")) and not out.exists()


def test_truncated_pickle_shard(tsv: Path, tmp_path: Path) -> None:
    files = _write_pickles(tmp_path / "emb", _entries(_vectors()))
    files[1].write_bytes(files[1].read_bytes()[:-100])
    _bad_import(tsv, files, tmp_path, r"wikipedia_passages_1.pkl: truncated pickle")


def test_pickle_that_would_run_code_is_refused(tsv: Path, tmp_path: Path) -> None:
    files = _write_pickles(tmp_path / "emb", _entries(_vectors()))
    with open(files[2], "wb") as f:
        pickle.dump([("wiki:21", np.zeros(DIM, np.float32)), ("x", print)], f)
    _bad_import(
        tsv,
        files,
        tmp_path,
        r"_2.pkl: not a readable embeddings pickle "
        r"\(refusing to load builtins.print\)",
    )


def test_parquet_without_embeddings_column(tsv: Path, tmp_path: Path) -> None:
    p = tmp_path / "train.parquet"
    pq.write_table(_table(_vectors(), _rows()).drop(["embeddings"]), p)
    _bad_import(
        tsv,
        [p],
        tmp_path,
        r"train.parquet: no 'embeddings' column "
        r"\(columns: id, text, title\)",
    )


def test_query_encoder_dim_must_match(
    tsv: Path, tmp_path: Path, dpr_dirs: tuple[Path, Path]
) -> None:
    files = _write_pickles(tmp_path / "emb", _entries(_vectors(dim=16)))
    with pytest.raises(ValueError, match="has dim 32 but the embeddings in .*_0.pkl have dim 16"):
        import_embeddings(tsv, files, tmp_path / "idx", _spec(dpr_dirs[1]), OPTIONS)
    assert not list(tmp_path.glob(".idx*")) and not (tmp_path / "idx").exists()


def test_importer_holds_one_batch_at_a_time(
    tsv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory, structurally: the reader hands out batches of at most batch_size, and by the
    time it reads a batch the importer has let go of all but the one it just used."""
    vecs = _vectors()
    pq.write_table(_table(vecs, _rows()), tmp_path / "t.parquet", row_group_size=N)
    real_iter = importer_mod.iter_embeddings
    alive: list[weakref.ref] = []
    sizes: list[int] = []

    def watched(*a, **k):  # type: ignore[no-untyped-def]
        for batch in real_iter(*a, **k):
            # the `for` loop variable still holds the previous batch; nothing older is alive
            assert sum(r() is not None for r in alive[:-1]) == 0
            alive.append(weakref.ref(batch.vectors))
            sizes.append(len(batch.ids))
            yield batch

    monkeypatch.setattr(importer_mod, "iter_embeddings", watched)
    import_embeddings(tsv, [tmp_path / "t.parquet"], tmp_path / "idx", _spec("/models/q"), OPTIONS)
    assert sizes == [1] + [4] * 7 + [2]  # the first: peeking at the dimension


def test_natural_order_and_reader_batches(tmp_path: Path) -> None:
    names = [f"wikipedia_passages_{i}.pkl" for i in (10, 2, 1, 0)]
    assert [p.name for p in natural_order(tmp_path / n for n in names)] == [
        f"wikipedia_passages_{i}.pkl" for i in (0, 1, 2, 10)
    ]
    files = _write_pickles(tmp_path, _entries(_vectors(), prefix=""), shards=2)
    batches = list(iter_embeddings(files, batch_size=4))
    assert [(b.path.name, b.first, len(b.ids)) for b in batches[:5]] == [
        ("wikipedia_passages_0.pkl", 0, 4),
        ("wikipedia_passages_0.pkl", 4, 4),
        ("wikipedia_passages_0.pkl", 8, 4),
        ("wikipedia_passages_0.pkl", 12, 3),
        ("wikipedia_passages_1.pkl", 0, 4),
    ]
    assert all(b.vectors.dtype == np.float32 for b in batches)
