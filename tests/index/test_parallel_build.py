"""One index built as N slices in parallel (build_slice / join_slices): the joined set serves
what one unsharded build of the same passages serves, and bad or partial input never becomes
a served index."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from openbook.index import (
    Encoder,
    IndexLoadError,
    LoadedIndex,
    build_index,
    build_slice,
    clear_encoder_cache,
    join_slices,
    open_index,
    read_index_set,
)
from openbook.index.cli import app
from openbook.index.parallel import count_passages, parts_dir, slice_dir
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.types import Passage
from openbook_gateway.retrieval import merge_results
from openbook_testkit.index import (
    QUESTIONS,
    make_tiny_dpr_encoders,
    random_vectors,
    word_rows,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[2]
N_PASSAGES = 300
# Small embedding shards: every slice writes several, so resuming has something to resume.
SHARD_SIZE = 64
runner = CliRunner()


def _same_topk(got: list[list[Passage]], want: list[list[Passage]], atol: float = 1e-5) -> None:
    """Same passages with the same scores, best first. Slices encode other batches than the
    unsharded build, so vectors agree to float rounding (~1e-7): passages whose scores tie to
    within that may trade places, nothing else may."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        np.testing.assert_allclose([p.score for p in g], [p.score for p in w], atol=atol)
        gs, ws = {p.id: p.score for p in g}, {p.id: p.score for p in w}
        for pid in gs.keys() & ws.keys():
            assert abs(gs[pid] - ws[pid]) <= atol, pid
        for pid in gs.keys() ^ ws.keys():  # in one top-k only: tied with the k-th
            assert abs(gs.get(pid, ws.get(pid)) - w[-1].score) <= atol, pid
        ties = [abs(a.score - b.score) <= atol for a, b in zip(w, w[1:], strict=False)]
        if not any(ties):
            assert [p.id for p in g] == [p.id for p in w]


def _open_set(root: Path, name: str, n: int) -> list[LoadedIndex]:
    return [open_index(root / f"shard-{i}" / name, verify=True) for i in range(n)]


def _close(indexes: list[LoadedIndex]) -> None:
    for idx in indexes:
        idx.close()


def _cli_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "words.jsonl", word_rows(N_PASSAGES))


@pytest.fixture(scope="module")
def unsharded(corpus: Path, dpr_dirs: tuple[Path, Path], tmp_path_factory) -> Path:
    """One flat build of the corpus, as build_index makes it."""
    out = tmp_path_factory.mktemp("unsharded") / "words"
    build_index(
        [corpus],
        out,
        IndexSpec(name="words", encoder=str(dpr_dirs[0]), query_encoder=str(dpr_dirs[1])),
        BuildOptions(batch_size=16, shard_size=SHARD_SIZE, progress=False),
    )
    return out


def _slice_args(corpus: Path, out: Path, dpr_dirs: tuple[Path, Path], n: int, i: int) -> list:
    return [
        "build",
        "-p",
        str(corpus),
        "--name",
        "words",
        "--out",
        str(out),
        "--encoder",
        str(dpr_dirs[0]),
        "--query-encoder",
        str(dpr_dirs[1]),
        "--batch-size",
        "16",
        "--shard-size",
        str(SHARD_SIZE),
        "--num-shards",
        str(n),
        "--shard-id",
        str(i),
        "--no-progress",
    ]


def test_two_processes_build_slices_at_once_and_the_set_serves_the_unsharded_top_k(
    corpus: Path, unsharded: Path, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "indexes" / "words-set"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "openbook_trainer",
                "index",
                *_slice_args(corpus, out, dpr_dirs, 2, i),
            ],
            cwd=ROOT,
            env=_cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text
    assert "built slice 0 of 2 (rows 0..149 of 300)" in outputs[0]
    assert "built slice 1 of 2 (rows 150..299 of 300)" in outputs[1]
    # Built, but nothing is served before the join: the slices wait in a hidden staging dir.
    assert not out.exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [".words-set.parts"]

    r = runner.invoke(
        app, ["join-shards", str(out), "--num-shards", "2", "--merge", str(out.parent / "merged")]
    )
    assert r.exit_code == 0, r.output
    assert "joined 'words': 2 shards, 300 passages" in r.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["merged", "words-set"]
    assert sorted(p.name for p in out.iterdir()) == ["shard-0", "shard-1", "shards.json"]

    shards = _open_set(out, "words", 2)
    index_set = read_index_set(out)
    with open_index(unsharded) as full, open_index(out.parent / "merged") as merged:
        offset = 0
        for i, s in enumerate(shards):
            m = s.manifest
            assert m.shard is not None
            assert {k: m.shard[k] for k in ("index", "count", "row_offset", "parent_count")} == {
                "index": i,
                "count": 2,
                "row_offset": offset,
                "parent_count": N_PASSAGES,
            }
            assert m.shard["parent_checksum"] == index_set.parent_checksum
            assert (m.name, m.encoder, m.query_encoder, m.dim, m.index_type, m.score_scale) == (
                full.manifest.name,
                full.manifest.encoder,
                full.manifest.query_encoder,
                full.manifest.dim,
                "flat",
                full.manifest.score_scale,
            )
            rows = list(range(m.count))
            assert [p.id for p in s.get_passages(rows)] == [
                p.id for p in full.get_passages([offset + r for r in rows])
            ]
            np.testing.assert_allclose(
                s.get_vectors(rows), full.get_vectors([offset + r for r in rows]), atol=1e-5
            )
            offset += m.count
        assert offset == N_PASSAGES

        q = random_vectors(20, full.manifest.dim, seed=3)
        texts = ["who wrote hamlet", "the largest planet in the solar system", "tea or coffee"]
        for k in (1, 5, 17, N_PASSAGES):
            want = full.search(SearchRequest(k=k, query_vectors=q))
            _same_topk(
                merge_results([s.search(SearchRequest(k=k, query_vectors=q)) for s in shards], k),
                want,
            )
            _same_topk(merged.search(SearchRequest(k=k, query_vectors=q)), want)
            want = full.search(SearchRequest(texts, k=k, retrieval="dense"))
            dense = [s.search(SearchRequest(texts, k=k, retrieval="dense")) for s in shards]
            _same_topk(merge_results(dense, k), want)
            _same_topk(merged.search(SearchRequest(texts, k=k, retrieval="dense")), want)
            # The merge rebuilds one bm25 view over all passages: hybrid as unsharded too.
            _same_topk(
                merged.search(SearchRequest(texts, k=k)),
                full.search(SearchRequest(texts, k=k)),
                atol=1e-4,
            )
        assert merged.manifest.shard is None and len(merged) == N_PASSAGES
        assert merged.views == full.views == ("dense", "bm25")
        assert all(s.views == ("dense", "bm25") for s in shards)
    _close(shards)


def test_minilm_slices_serve_the_facts_index_and_rejoin_as_no_ops(
    facts_jsonl: Path, facts_index: LoadedIndex, tmp_path: Path
) -> None:
    out = tmp_path / "facts-set"
    for i in (2, 0, 1):  # any order
        res = build_slice(
            [facts_jsonl],
            out,
            IndexSpec(name="facts"),
            BuildOptions(progress=False),
            num_shards=3,
            shard_id=i,
        )
        assert res.state == "built" and res.path == slice_dir(out, i, "facts")
    serve = tmp_path / "indexes" / "shards"
    (serve / "shard-0" / "other").mkdir(parents=True)  # another index already served there
    res = join_slices(out, 3, into=serve, progress=False)
    assert res.state == "joined"
    assert res.installed == [serve / f"shard-{i}" / "facts" for i in range(3)]
    assert not parts_dir(out).exists()

    questions = list(QUESTIONS.values())
    for root in (out, serve):
        shards = _open_set(root, "facts", 3)
        assert all(s.manifest.score_scale == facts_index.manifest.score_scale for s in shards)
        dense = [s.search(SearchRequest(questions, k=5, retrieval="dense")) for s in shards]
        merged = merge_results(dense, 5)
        _same_topk(merged, facts_index.search(SearchRequest(questions, k=5, retrieval="dense")))
        assert [hits[0].id for hits in merged] == list(QUESTIONS)
        # Hybrid (the default): BM25 with per-slice statistics, close to the unsharded.
        merged = merge_results([s.search(SearchRequest(questions, k=5)) for s in shards], 5)
        assert [hits[0].id for hits in merged] == list(QUESTIONS)
        _close(shards)

    # Every later step is a no-op: a pod retried after the join, a second join, a re-install.
    again = build_slice(
        [facts_jsonl],
        out,
        IndexSpec(name="facts"),
        BuildOptions(progress=False),
        num_shards=3,
        shard_id=1,
    )
    assert again.state == "already joined" and again.path == out / "shard-1" / "facts"
    assert join_slices(out, 3, into=serve, progress=False).state == "already joined"
    r = runner.invoke(app, ["info", str(out)])
    assert r.exit_code == 0 and json.loads(r.stdout)["count"] == 30
    with pytest.raises(ValueError, match="holds a set of 3 shards, not 2"):
        join_slices(out, 2)


def test_concurrent_joins_take_turns(facts_jsonl: Path, tmp_path: Path) -> None:
    out = tmp_path / "set"
    for i in range(2):
        build_slice(
            [facts_jsonl],
            out,
            IndexSpec(name="f", index_type="bm25"),
            BuildOptions(progress=False),
            num_shards=2,
            shard_id=i,
        )
    states: list[str] = []
    threads = [
        threading.Thread(target=lambda: states.append(join_slices(out, 2).state)) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(states) == ["already joined"] * 3 + ["joined"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # no lock file left behind


def test_missing_slices_are_listed_and_if_complete_waits(facts_jsonl: Path, tmp_path: Path) -> None:
    out = tmp_path / "set"
    build_slice(
        [facts_jsonl],
        out,
        IndexSpec(name="f", index_type="bm25"),
        BuildOptions(progress=False),
        num_shards=3,
        shard_id=1,
    )
    with pytest.raises(ValueError, match=r"1 of 3 slices built; missing: shard 0, shard 2$"):
        join_slices(out, 3)
    res = join_slices(out, 3, if_complete=True)
    assert res.state == "incomplete" and res.missing == ["shard 0", "shard 2"]
    r = runner.invoke(app, ["join-shards", str(out), "--num-shards", "3", "--if-complete"])
    assert r.exit_code == 0, r.output
    assert "1 of 3 slices built; missing: shard 0, shard 2. Not joining yet" in r.output
    r = runner.invoke(app, ["join-shards", str(out), "--num-shards", "3"])
    assert r.exit_code == 2 and "missing: shard 0, shard 2" in r.output
    assert not out.exists()
    # Slices of another shard count are not silently left out.
    build_slice(
        [facts_jsonl],
        out,
        IndexSpec(name="f", index_type="bm25"),
        BuildOptions(progress=False),
        num_shards=3,
        shard_id=0,
    )
    build_slice(
        [facts_jsonl],
        out,
        IndexSpec(name="f", index_type="bm25"),
        BuildOptions(progress=False),
        num_shards=3,
        shard_id=2,
    )
    with pytest.raises(ValueError, match="holds shard-2 beyond the 2 shards asked for"):
        join_slices(out, 2)
    assert join_slices(out, 3).state == "joined"


def test_bad_slice_arguments(facts_jsonl: Path, tmp_path: Path) -> None:
    base = [
        "build",
        "-p",
        str(facts_jsonl),
        "--name",
        "f",
        "--out",
        str(tmp_path / "o"),
        "--type",
        "bm25",
    ]
    for args, msg in [
        (
            ["--num-shards", "4", "--shard-id", "4"],
            "shard-id 4 out of range for 4 shards (expected 0..3)",
        ),
        (["--num-shards", "4", "--shard-id", "-1"], "shard-id -1 out of range for 4 shards"),
        (["--shard-id", "0"], "--num-shards and --shard-id go together"),
        (["--num-shards", "31", "--shard-id", "0"], "cannot split 30 passages into 31 shards"),
    ]:
        r = runner.invoke(app, [*base, *args])
        assert r.exit_code == 2, (args, r.output)
        assert msg in " ".join(r.output.split()) and "Traceback" not in r.output
    with pytest.raises(ValueError, match="'ivfpq' trains a quantizer on the whole corpus"):
        build_slice(
            [facts_jsonl],
            tmp_path / "o",
            IndexSpec(name="f", index_type="ivfpq"),
            num_shards=2,
            shard_id=0,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_duplicate_ids_across_slices_are_refused(tmp_path: Path) -> None:
    rows = word_rows(10)
    rows[8]["id"] = rows[1]["id"]  # in slice 1 of 2, a duplicate of a slice-0 passage
    src = write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(ValueError, match="duplicate passage id 'w1'"):
        count_passages([src], "auto", 100)
    assert count_passages([write_jsonl(tmp_path / "ok.jsonl", word_rows(10))], "auto", 100) == 10
    with pytest.raises(ValueError, match="duplicate passage id 'w1'"):
        build_slice(
            [src], tmp_path / "o", IndexSpec(name="f", index_type="bm25"), num_shards=2, shard_id=0
        )


BASE = IndexSpec(name="f", index_type="bm25")
QUIET = BuildOptions(progress=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_words": 5}, "shard 1 was built with max_words 5, shard 0 with 100"),
        ({"score_scale": 2.0}, "shard 1 was built with score_scale 2.0, shard 0 with 1.0"),
        ({"num_shards": 3}, "shard 1 was built with shard count 3, shard 0 with 2"),
        ({"inputs": "other"}, "shard 1 was built with inputs ["),
    ],
)
def test_slices_of_different_builds_are_refused_naming_the_setting(
    facts_jsonl: Path, tmp_path: Path, change: dict, message: str
) -> None:
    out = tmp_path / "set"
    build_slice([facts_jsonl], out, BASE, QUIET, num_shards=2, shard_id=0)
    change = dict(change)
    num_shards = change.pop("num_shards", 2)
    inputs = [facts_jsonl]
    if change.pop("inputs", None):
        inputs = [write_jsonl(tmp_path / "other.jsonl", word_rows(40))]
    spec = dataclasses.replace(BASE, **change)
    build_slice(inputs, out, spec, QUIET, num_shards=num_shards, shard_id=1)
    with pytest.raises(ValueError, match=f"shard 1 cannot join shard 0: {re.escape(message)}"):
        join_slices(out, 2)
    assert not out.exists()
    # The same slice built again with the other settings is refused, unless replaced.
    with pytest.raises(ValueError, match=r"holds a slice of another build \(it was built with"):
        build_slice([facts_jsonl], out, BASE, QUIET, num_shards=2, shard_id=1)
    replace = BuildOptions(progress=False, overwrite=True)
    build_slice([facts_jsonl], out, BASE, replace, num_shards=2, shard_id=1)
    assert join_slices(out, 2).state == "joined"


def test_slices_with_other_encoders_or_weights_are_refused(
    facts_jsonl: Path, dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    other = make_tiny_dpr_encoders(tmp_path / "other", seed=7)[0]
    options = BuildOptions(batch_size=8, progress=False)
    dpr = IndexSpec(name="f", encoder=str(dpr_dirs[0]))
    out = tmp_path / "set"
    build_slice([facts_jsonl], out, dpr, options, num_shards=2, shard_id=0)
    other_spec = IndexSpec(name="f", encoder=str(other))
    build_slice([facts_jsonl], out, other_spec, options, num_shards=2, shard_id=1)
    with pytest.raises(ValueError) as err:
        join_slices(out, 2)
    assert str(err.value) == (
        f"shard 1 cannot join shard 0: shard 1 was built with encoder {str(other)!r}, "
        f"shard 0 with {str(dpr_dirs[0])!r}"
    )
    r = runner.invoke(app, ["join-shards", str(out), "--num-shards", "2"])
    assert r.exit_code == 2 and "shard 1 was built with encoder" in r.output

    # One precision for all: a bfloat16 slice (say, on another GPU model) is not a float32 one.
    out = tmp_path / "set1"
    build_slice([facts_jsonl], out, dpr, options, num_shards=2, shard_id=0)
    bf16 = dataclasses.replace(options, precision="bfloat16")
    build_slice([facts_jsonl], out, dpr, bf16, num_shards=2, shard_id=1)
    with pytest.raises(ValueError, match="with precision 'bfloat16', shard 0 with 'float32'$"):
        join_slices(out, 2)

    # Same directory, retrained weights: named by the weights' digest.
    enc = tmp_path / "enc"
    out = tmp_path / "set2"
    make_tiny_dpr_encoders(enc, seed=1)
    retrained = IndexSpec(name="f", encoder=str(enc / "ctx_encoder"))
    build_slice([facts_jsonl], out, retrained, options, num_shards=2, shard_id=0)
    make_tiny_dpr_encoders(enc, seed=2)
    clear_encoder_cache()  # as a process on another node would load it
    build_slice([facts_jsonl], out, retrained, options, num_shards=2, shard_id=1)
    with pytest.raises(
        ValueError,
        match=r"built with encoder weights \(digest\) [0-9a-f]{12}, shard 0 with [0-9a-f]{12}$",
    ):
        join_slices(out, 2)
    assert not out.exists()


def test_a_slice_interrupted_mid_embedding_resumes(
    corpus: Path, dpr_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = IndexSpec(name="words", encoder=str(dpr_dirs[0]))
    options = BuildOptions(batch_size=16, shard_size=SHARD_SIZE, progress=False)
    slice_1 = {"num_shards": 2, "shard_id": 1}
    calls: list[int] = []
    real = Encoder.encode

    def encode(self, texts, batch_size=64, titles=None, **more):  # type: ignore[no-untyped-def]
        if fail and len(calls) == 1:
            raise KeyboardInterrupt  # a killed pod, as far as the build can tell
        calls.append(len(texts))
        return real(self, texts, batch_size, titles, **more)

    monkeypatch.setattr(Encoder, "encode", encode)
    out = tmp_path / "set"
    fail = True
    with pytest.raises(KeyboardInterrupt):
        build_slice([corpus], out, spec, options, **slice_1)
    assert calls == [SHARD_SIZE]  # rows 150..299: shards of 64, 64, 22; the first one done
    assert not out.exists() and not slice_dir(out, 1, "words").exists()
    assert join_slices(out, 2, if_complete=True).missing == [
        "shard 0",
        "shard 1 (partial build present)",
    ]

    fail, calls[:] = False, []
    res = build_slice([corpus], out, spec, options, **slice_1)
    assert res.state == "built" and calls == [SHARD_SIZE, 150 - 2 * SHARD_SIZE]  # the rest only
    monkeypatch.undo()
    fresh = build_slice([corpus], tmp_path / "fresh", spec, options, **slice_1)
    with open_index(res.path) as a, open_index(fresh.path) as b:
        np.testing.assert_array_equal(a.get_vectors(range(150)), b.get_vectors(range(150)))
        assert a.manifest.shard == b.manifest.shard


def test_merge_into_a_trained_type_and_refusals(
    facts_jsonl: Path, facts_index, tmp_path: Path
) -> None:
    out = tmp_path / "set"
    for i in range(2):
        build_slice(
            [facts_jsonl],
            out,
            IndexSpec(name="facts"),
            BuildOptions(progress=False),
            num_shards=2,
            shard_id=i,
        )
    res = join_slices(out, 2, merge=tmp_path / "sq8", merge_type="hnsw-sq8", progress=False)
    assert res.merged is not None and res.merged.index_type == "hnsw-sq8"
    with open_index(tmp_path / "sq8") as idx:
        hits = idx.search(SearchRequest(list(QUESTIONS.values()), k=1))
        assert [h[0].id for h in hits] == list(QUESTIONS)
    with pytest.raises(ValueError, match="dense slices merge into a dense type"):
        join_slices(out, 2, merge=tmp_path / "bm", merge_type="bm25")
    with pytest.raises(ValueError, match="already exists and is not this merge"):
        join_slices(out, 2, merge=tmp_path / "sq8", merge_type="flat")
    with pytest.raises(IndexLoadError, match="not a joined index set"):
        join_slices(tmp_path / "sq8", 2)


def test_install_refuses_another_index_of_the_same_name_before_installing(
    facts_jsonl: Path, tmp_path: Path
) -> None:
    out, serve = tmp_path / "set", tmp_path / "shards"
    for i in range(2):
        build_slice(
            [facts_jsonl],
            out,
            IndexSpec(name="f", index_type="bm25"),
            BuildOptions(progress=False),
            num_shards=2,
            shard_id=i,
        )
    (serve / "shard-1" / "f").mkdir(parents=True)  # an older index "f", still served there
    with pytest.raises(ValueError, match=r"shard-1/f exists and is another index"):
        join_slices(out, 2, into=serve)
    assert out.is_dir()  # the set is joined; only the install was refused
    assert not (serve / "shard-0").exists()  # nothing installed
    (serve / "shard-1" / "f").rmdir()
    res = join_slices(out, 2, into=serve)
    assert res.state == "already joined" and len(res.installed) == 2
    for i in range(2):  # hard links of the set's files, manifest identical
        a, b = out / f"shard-{i}" / "f", serve / f"shard-{i}" / "f"
        assert (a / "manifest.json").read_text() == (b / "manifest.json").read_text()
        assert os.path.samefile(a / "passages.sqlite", b / "passages.sqlite")
        with open_index(b) as idx:
            assert idx.manifest.shard["index"] == i


def test_join_beside_a_build_that_just_finished_or_a_rebuild(
    facts_jsonl: Path, tmp_path: Path
) -> None:
    from openbook.index.stages import build_lock
    from openbook.storage.artifacts import partial_dir

    out = tmp_path / "set"
    for i in range(2):
        build_slice(
            [facts_jsonl],
            out,
            IndexSpec(name="f", index_type="bm25"),
            BuildOptions(progress=False),
            num_shards=2,
            shard_id=i,
        )
    staged = slice_dir(out, 1, "f")
    # build_lock stands for a builder of slice 1: holding its lock, with a partial dir it is a
    # rebuild in progress; without one, a build that has published and is about to unlock.
    with build_lock(staged):
        partial_dir(staged).mkdir()
        with pytest.raises(ValueError, match=r"shard-1/f is being rebuilt"):
            join_slices(out, 2)
        partial_dir(staged).rmdir()
        assert join_slices(out, 2).state == "joined"
    assert sorted(p.name for p in (out / "shard-1").iterdir()) == ["f"]
