"""`openbook index build` / `import` straight into Milvus (openbook/index/milvus_build.py) on a
real Milvus Lite, no mocks: a build cut short part way resumes from its last written shard,
holds every passage once, and searches as the files build of the same corpus does; an import
of precomputed vectors does the same through the CLI; the compressed type is declared to
Milvus with the spec's parameters (and what Milvus Lite does with it is checked)."""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from openbook.errors import AlreadyExists
from openbook.index import LoadedIndex
from openbook.index.cli import app as index_cli
from openbook.index.embedding_files import EmbeddingsError
from openbook.index.faiss_index import default_params
from openbook.index.manifest import IndexLoadError
from openbook.index.milvus_build import MilvusTarget, build_into_milvus, import_into_milvus
from openbook.index.milvus_engine import (
    MilvusEngine,
    MilvusIndex,
    milvus_index_of,
    milvus_search_params,
)
from openbook.index.request import SearchRequest
from openbook.index.spec import AnnParams, BuildOptions, IndexSpec
from openbook_testkit.index import build_words_index, word_rows, write_dpr_tsv, write_jsonl

pytest.importorskip("milvus_lite")

QUERIES = ["tower paris", "who wrote hamlet", "largest animal on earth", "tea or coffee"]


class Interrupted(Exception):
    """What the batch hook raises: the build is killed after a shard."""


@pytest.fixture(scope="module")
def built(dpr_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> LoadedIndex:
    """The files build of the corpus (flat, tiny DPR encoders, dense + BM25)."""
    return build_words_index(tmp_path_factory.mktemp("built"), dpr_dirs)


def _all_pids(index: MilvusIndex) -> list[str]:
    rows = index.client.query(index.passages, filter="", output_fields=["pid"], limit=16_384)
    return sorted(r["pid"] for r in rows)


def _assert_searches_as(index: MilvusIndex, built: LoadedIndex) -> None:
    for mode in ("dense", "bm25", "hybrid"):
        want = built.search(SearchRequest(QUERIES, k=5, retrieval=mode))
        got = index.search(SearchRequest(QUERIES, k=5, retrieval=mode))
        for w, g in zip(want, got, strict=True):
            assert [p.id for p in g] == [p.id for p in w], mode
            assert [p.score for p in g] == pytest.approx([p.score for p in w], rel=1e-4, abs=1e-4)


def test_a_build_cut_short_resumes_and_searches_as_the_files_build(
    built: LoadedIndex, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    ctx, q = dpr_dirs
    corpus = write_jsonl(tmp_path / "corpus.jsonl", word_rows(150, seed=3))
    target = MilvusTarget(uri=str(tmp_path / "milvus.db"), work_dir=tmp_path / "work")
    spec = IndexSpec(name="words", index_type="flat", encoder=str(ctx), query_encoder=str(q))
    options = BuildOptions(progress=False, shard_size=40)  # 4 shards: 40, 80, 120, 150

    def killed_after(shard_end: int) -> Callable[[int, int], None]:
        def hook(done: int, total: int) -> None:
            batches.append((done, total))
            if done == shard_end:
                raise Interrupted

        return hook

    batches: list[tuple[int, int]] = []
    with pytest.raises(Interrupted):
        build_into_milvus([corpus], target, spec, options, on_batch=killed_after(40))
    engine = MilvusEngine(target.uri)
    try:
        with pytest.raises(IndexLoadError, match=r"cut short \(40 of 150 passages\): run the same"):
            engine.open("words")  # not served half built
    finally:
        engine.close()
    assert target.work_dir.is_dir()  # its passages and BM25 view, kept to resume

    # Cut short again: only the shards after the last one written are encoded and written.
    batches.clear()
    with pytest.raises(Interrupted):
        build_into_milvus([corpus], target, spec, options, on_batch=killed_after(80))
    assert batches == [(80, 150)]

    # The CLI, as a user re-runs it, finishes it.
    command = ["build", "-p", str(corpus), "--name", "words", "--encoder", str(ctx)]
    command += ["--query-encoder", str(q), "--engine", "milvus", "--milvus-uri", target.uri]
    command += ["--work-dir", str(target.work_dir), "--shard-size", "40", "--no-progress"]
    again = CliRunner().invoke(index_cli, command)
    assert again.exit_code == 0, again.output
    assert "resumed a build cut short at passage 80" in again.output
    assert "built index 'words' (flat, 150 passages, dim 32) in " in again.output
    assert not target.work_dir.exists()
    engine = MilvusEngine(target.uri)
    try:
        index = engine.open("words")
        assert len(index) == 150
        # each passage once
        assert _all_pids(index) == sorted(p.id for p in built.get_passages(range(len(built))))
        # The manifest pairs the encoders as a copy of the files build does.
        m, b = index.manifest, built.manifest
        assert (m.encoder, m.query_encoder, m.dim, m.normalize, m.score_scale) == (
            b.encoder,
            b.query_encoder,
            b.dim,
            b.normalize,
            b.score_scale,
        )
        assert m.index_type == "flat" and m.views == ["dense", "bm25"]
        assert index.default_retrieval == built.manifest.default_retrieval
        _assert_searches_as(index, built)
        assert index.get("w7").document.text == built.get_passages([7])[0].text
    finally:
        engine.close()
    # Built and complete: the same build again finds it there.
    with pytest.raises(AlreadyExists):
        build_into_milvus([corpus], target, spec, options)


def test_import_writes_precomputed_vectors_into_milvus(
    built: LoadedIndex, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """`openbook index import --engine milvus`: the files build's vectors as DPR pickles, read
    and written in shards, the same top ids; IVF-PQ declared with the spec's parameters."""
    ctx, q = dpr_dirs
    passages = built.get_passages(range(len(built)))
    ids = [p.id for p in passages]
    vectors = built.get_vectors(list(range(len(built))))
    rows = [{"id": p.id, "title": p.title, "text": p.text} for p in passages]
    tsv = write_dpr_tsv(tmp_path / "psgs.tsv", rows)
    emb = tmp_path / "wikipedia_passages_0.pkl"
    with open(emb, "wb") as f:
        pickle.dump([(f"wiki:{i}", np.asarray(v)) for i, v in zip(ids, vectors, strict=True)], f)
    uri = str(tmp_path / "milvus.db")
    args = ["import", str(emb), "-p", str(tsv), "--name", "pq", "--type", "ivfpq"]
    args += ["--doc-encoder", str(ctx), "--query-encoder", str(q), "--score-scale", "1"]
    args += ["--engine", "milvus", "--milvus-uri", uri, "--work-dir", str(tmp_path / "w")]
    args += ["--shard-size", "64", "--no-progress", "--nprobe", "4", "--rerank", "3"]
    result = CliRunner().invoke(index_cli, args)
    assert result.exit_code == 0, result.output
    assert "imported index 'pq' (ivfpq, 150 passages, dim 32) in " in result.output
    assert f"-> Milvus at {uri} (views: dense, bm25)" in result.output

    engine = MilvusEngine(uri)
    try:
        index = engine.open("pq")
        assert _all_pids(index) == sorted(ids)
        # Declared as the spec says: nlist, m and nbits of the files build's IVF-PQ defaults
        # (Milvus Lite's describe_index names the type only; a cluster's, its parameters too).
        want = default_params("ivfpq", 150, 32, AnnParams(nprobe=4))
        described = index.client.describe_index(index.passages, "vector")
        assert described["index_type"] == "IVF_PQ"
        declared = {"nlist": want["nlist"], "m": want["pq_m"], "nbits": want["nbits"]}
        assert milvus_index_of(index.manifest) == ("IVF_PQ", declared)
        assert milvus_search_params(index.manifest, 5) == {"nprobe": want["nprobe"]}
        # Milvus Lite 3.2 builds no IVF_PQ (its factory: "reserved for a future phase"): it
        # keeps the declaration for a cluster and searches these segments exactly, so the
        # dense top ids are the flat files build's.
        queries = np.random.default_rng(0).standard_normal((6, 32)).astype("f4")
        got = index.search(SearchRequest(k=5, query_vectors=queries))
        want_hits = built.search(SearchRequest(k=5, query_vectors=queries))
        assert [[p.id for p in h] for h in got] == [[p.id for p in h] for h in want_hits]
        # --rerank 3: the top 15 re-scored exactly with the stored vectors, as files do.
        assert index.manifest.index_params["rerank"] == 3
        for g, w in zip(got, want_hits, strict=True):
            assert [p.score for p in g] == pytest.approx([p.score for p in w], rel=1e-5)
    finally:
        engine.close()


def test_the_cli_refuses_what_a_milvus_build_cannot_take(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", word_rows(5))
    base = ["build", "-p", str(corpus), "--name", "x", "--no-progress"]
    runner = CliRunner()
    no_uri = runner.invoke(index_cli, [*base, "--engine", "milvus"], env={})
    assert no_uri.exit_code == 2 and "--milvus-uri (or OPENBOOK_MILVUS_URI)" in no_uri.output
    uri = ["--engine", "milvus", "--milvus-uri", str(tmp_path / "m.db")]
    both = runner.invoke(index_cli, [*base, *uri, "--out", str(tmp_path / "o")])
    assert both.exit_code == 2 and "--out: a build with --engine milvus" in both.output
    bm25 = runner.invoke(index_cli, [*base, *uri, "--type", "bm25"])
    assert bm25.exit_code == 2 and "index_type: the milvus engine holds dense" in bm25.output
    bad = runner.invoke(index_cli, [*base, "--engine", "milvus", "--milvus-uri", "var/m"])
    assert bad.exit_code == 2 and "OPENBOOK_MILVUS_URI: expected" in bad.output
    slices = runner.invoke(index_cli, [*base, *uri, "--num-shards", "2", "--shard-id", "0"])
    assert slices.exit_code == 2 and "--num-shards: slices are files builds" in slices.output
    files = runner.invoke(index_cli, base, env={"OPENBOOK_INDEX_ENGINE": "files"})
    assert files.exit_code == 2 and "--out: name the index directory" in files.output
    out = ["--out", str(tmp_path / "o"), "--milvus-shards", "2"]
    stray = runner.invoke(index_cli, [*base, *out], env={"OPENBOOK_INDEX_ENGINE": "files"})
    assert stray.exit_code == 2 and "are --engine milvus options" in stray.output


def test_a_document_whose_passages_are_apart_keeps_all_its_text(
    dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Documents are written as the passages stream by, a batch at a time: a document whose
    passages are not consecutive (here more than a batch of documents apart) still holds
    all of them, in row order, as the files engine reads a built document."""
    ctx, q = dpr_dirs
    rows = [{"id": "a#0", "title": "A", "text": "tower paris"}]
    rows += [{"id": f"d{i}", "title": "D", "text": "moon tea"} for i in range(1_001)]
    rows += [{"id": "a#1", "title": "A", "text": "python language"}]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    target = MilvusTarget(uri=str(tmp_path / "milvus.db"), work_dir=tmp_path / "work")
    spec = IndexSpec(name="apart", encoder=str(ctx), query_encoder=str(q))
    build_into_milvus([corpus], target, spec, BuildOptions(progress=False, batch_size=256))
    engine = MilvusEngine(target.uri)
    try:
        index = engine.open("apart")
        stored = index.get("a")
        assert stored.document.text == "tower paris python language"
        assert stored.passage_ids == ("a#0", "a#1")
        assert index.get("d1000").document.text == "moon tea"
        first = index.list(limit=1_000)
        rest = index.list(first.next_cursor, limit=1_000)
        assert len(first.ids) + len(rest.ids) == 1_002 and rest.next_cursor is None
    finally:
        engine.close()


KILLED_BUILD = """
import os, signal, sys
from pathlib import Path
from openbook.index.milvus_build import MilvusTarget, build_into_milvus, import_into_milvus
from openbook.index.spec import BuildOptions, IndexSpec

corpus, uri, work, ctx, q = sys.argv[1:]

def kill_after_two_shards(done, total):
    if done == 80:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no finally, no close

build_into_milvus(
    [Path(corpus)],
    MilvusTarget(uri=uri, work_dir=Path(work)),
    IndexSpec(name="words", encoder=ctx, query_encoder=q),
    BuildOptions(progress=False, shard_size=40),
    on_batch=kill_after_two_shards,
)
"""


def test_a_build_killed_mid_way_resumes_from_what_milvus_kept(
    built: LoadedIndex, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """kill -9 of the building process after its second shard (Milvus Lite in that process,
    its file left as the kill left it): the same build run again completes the index with
    every passage once and the files build's top ids."""
    ctx, q = dpr_dirs
    corpus = write_jsonl(tmp_path / "corpus.jsonl", word_rows(150, seed=3))
    uri, work = str(tmp_path / "milvus.db"), tmp_path / "work"
    script = tmp_path / "killed_build.py"
    script.write_text(KILLED_BUILD)
    args = [str(corpus), uri, str(work), str(ctx), str(q)]
    killed = subprocess.run([sys.executable, str(script), *args], capture_output=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]

    target = MilvusTarget(uri=uri, work_dir=work)
    spec = IndexSpec(name="words", encoder=str(ctx), query_encoder=str(q))
    resumed = build_into_milvus([corpus], target, spec, BuildOptions(progress=False, shard_size=40))
    assert resumed.resumed_at == 80 and resumed.count == 150  # both shards kept
    engine = MilvusEngine(uri)
    try:
        index = engine.open("words")
        assert _all_pids(index) == sorted(p.id for p in built.get_passages(range(len(built))))
        _assert_searches_as(index, built)
    finally:
        engine.close()


def test_an_import_of_bad_input_leaves_nothing_behind(tmp_path: Path) -> None:
    """A passage without a vector: refused naming it, and neither the index under way in
    Milvus nor the work directory stays (running it again cannot fix the input)."""
    rows = [{"id": str(i), "title": f"T{i}", "text": f"tower paris {i}"} for i in range(5)]
    tsv = write_dpr_tsv(tmp_path / "psgs.tsv", rows)
    emb = tmp_path / "wikipedia_passages_0.pkl"
    vectors = np.random.default_rng(0).standard_normal((4, 8)).astype("f4")
    with open(emb, "wb") as f:
        pickle.dump([(f"wiki:{i}", vectors[i]) for i in range(4)], f)
    target = MilvusTarget(uri=str(tmp_path / "milvus.db"), work_dir=tmp_path / "work")
    spec = IndexSpec(name="bad", encoder="elsewhere/ctx", query_encoder="elsewhere/q")
    with pytest.raises(EmbeddingsError, match=r"passage '4' \(row 4\) and later have no vector"):
        import_into_milvus(tsv, [emb], target, spec, BuildOptions(progress=False, shard_size=2))
    assert not target.work_dir.exists()
    engine = MilvusEngine(target.uri)
    try:
        assert engine.describe("bad") is None
    finally:
        engine.close()
