"""``BuildOptions.reuse_vectors_from``: a build takes the vectors of passages another index of
the same encoder already holds (the demo's two snapshots share most of theirs) and encodes only
the rest; the index it builds searches as one built from scratch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from openbook.index import build_index, load_encoder, open_index
from openbook.index.cli import app as index_cli
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.vectors import VectorDonors
from openbook_testkit.index import fact_rows, make_tiny_dpr_encoders, write_jsonl


def _build(tmp: Path, name: str, rows: list[dict], **options) -> Path:
    out = tmp / name
    build_index(
        [write_jsonl(tmp / f"{name}.jsonl", rows)],
        out,
        IndexSpec(name=name),
        BuildOptions(progress=False, **options),
    )
    return out


def test_a_build_reuses_identical_passages_and_encodes_the_rest(tmp_path, monkeypatch):
    rows = fact_rows()
    donor = _build(tmp_path, "donor", rows[:20])
    fresh = _build(tmp_path, "fresh", rows[5:])  # 15 passages shared, 10 new
    encoder = load_encoder("all-MiniLM-L6-v2", role="document")
    encoded: list[int] = []
    original = type(encoder).encode

    def counting(self, texts, *args, **kwargs):
        encoded.append(len(texts))
        return original(self, texts, *args, **kwargs)

    monkeypatch.setattr(type(encoder), "encode", counting)
    reused = _build(tmp_path, "reused", rows[5:], reuse_vectors_from=(donor,))
    # the donor's sample is re-encoded to check it, then only the 10 passages it lacks
    assert encoded == [VectorDonors.SAMPLE, 10]
    with open_index(fresh) as a, open_index(reused) as b:
        np.testing.assert_allclose(
            b.get_vectors(range(len(b))), a.get_vectors(range(len(a))), rtol=0, atol=1e-5
        )
        questions = ["Who wrote Hamlet?", "When was the tower in Paris built?"]
        assert [[h.id for h in hits] for hits in b.search(SearchRequest(questions, k=3))] == [
            [h.id for h in hits] for hits in a.search(SearchRequest(questions, k=3))
        ]


def test_a_donor_of_another_encoder_or_not_an_index_gives_nothing(tmp_path):
    ctx_dir, _ = make_tiny_dpr_encoders(tmp_path / "dpr", hidden_size=16)
    rows = fact_rows()
    other = tmp_path / "other"
    build_index(
        [write_jsonl(tmp_path / "other.jsonl", rows)],
        other,
        IndexSpec(name="other", encoder=str(ctx_dir)),
        BuildOptions(progress=False),
    )
    encoder = load_encoder("all-MiniLM-L6-v2", role="document")
    donors = VectorDonors.open([other, tmp_path / "missing"], encoder, 8, "float32")
    assert len(donors) == 0


def test_a_donor_whose_vectors_the_encoder_no_longer_computes_gives_nothing(tmp_path):
    donor = _build(tmp_path, "donor", fact_rows())
    vectors = np.load(donor / "vectors.npy")
    np.save(donor / "vectors.npy", -vectors)  # as if encoded by other weights
    encoder = load_encoder("all-MiniLM-L6-v2", role="document")
    assert len(VectorDonors.open([donor], encoder, 8, "float32")) == 0


def test_the_cli_takes_reuse_vectors_from(tmp_path):
    rows = fact_rows()
    donor = _build(tmp_path, "donor", rows)
    passages = write_jsonl(tmp_path / "again.jsonl", rows)
    out = tmp_path / "again"
    args = ["build", "--passages", str(passages), "--name", "again", "--out", str(out)]
    result = CliRunner().invoke(
        index_cli, [*args, "--reuse-vectors-from", str(donor), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    with open_index(out) as a, open_index(donor) as b:
        np.testing.assert_allclose(
            a.get_vectors(range(len(a))), b.get_vectors(range(len(b))), rtol=0, atol=1e-5
        )
