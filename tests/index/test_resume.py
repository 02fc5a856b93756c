"""An interrupted build leaves no index behind and resumes without re-encoding done shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openbook.index import BuildOptions, Encoder, IndexLoadError, IndexSpec, build_index, open_index
from openbook_testkit.index import random_rows, write_jsonl

N, SHARD = 40, 10
_REAL_ENCODE = Encoder.encode


class Boom(RuntimeError):
    pass


def _count_encodes(monkeypatch: pytest.MonkeyPatch, fail_on_call: int | None) -> list[int]:
    """Patch Encoder.encode to record rows per call and optionally raise on the n-th call."""
    calls: list[int] = []
    real = _REAL_ENCODE

    def encode(self: Encoder, texts, batch_size=64, titles=None, **kw):  # type: ignore[no-untyped-def]
        if fail_on_call is not None and len(calls) + 1 == fail_on_call:
            raise Boom("interrupted")
        calls.append(len(texts))
        return real(self, texts, batch_size, titles=titles, **kw)

    monkeypatch.setattr(Encoder, "encode", encode)
    return calls


def test_resume_skips_finished_shards(
    dpr_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "r.jsonl", random_rows(N))
    out = tmp_path / "idx"
    # the build encodes one embedding shard per encode() call
    spec = IndexSpec(name="r", encoder=str(dpr_dirs[0]))
    options = BuildOptions(shard_size=SHARD, batch_size=4, progress=False)

    calls = _count_encodes(monkeypatch, fail_on_call=3)
    with pytest.raises(Boom):
        build_index([src], out, spec, options)
    assert calls == [SHARD, SHARD]
    assert not out.exists()  # half-built index is not visible under its name
    with pytest.raises(IndexLoadError):
        open_index(out)
    partial = tmp_path / ".idx.partial"
    assert len(list((partial / "_build" / "shards").glob("shard-*.npy"))) == 2

    # corrupt one finished shard: it must be recomputed, the other one reused
    shard1 = partial / "_build" / "shards" / "shard-00001.npy"
    shard1.write_bytes(shard1.read_bytes()[:-8])
    calls = _count_encodes(monkeypatch, fail_on_call=None)
    build_index([src], out, spec, options)
    assert calls == [SHARD, SHARD, SHARD]  # shards 1, 2, 3; shard 0 reused
    assert not partial.exists()

    # identical to an uninterrupted build
    monkeypatch.undo()
    build_index([src], tmp_path / "fresh", spec, options)
    with open_index(out) as a, open_index(tmp_path / "fresh") as b:
        np.testing.assert_allclose(a.get_vectors(range(N)), b.get_vectors(range(N)), atol=1e-6)


def test_changed_inputs_discard_partial_build(
    dpr_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "r.jsonl", random_rows(N))
    out = tmp_path / "idx"
    spec = IndexSpec(name="r", encoder=str(dpr_dirs[0]))
    options = BuildOptions(shard_size=SHARD, batch_size=4, progress=False)
    _count_encodes(monkeypatch, fail_on_call=2)
    with pytest.raises(Boom):
        build_index([src], out, spec, options)
    write_jsonl(src, random_rows(N, seed=1))  # different corpus now
    calls = _count_encodes(monkeypatch, fail_on_call=None)
    build_index([src], out, spec, options)
    assert calls == [SHARD] * 4  # nothing reused from the stale partial build
