"""openbook.storage.artifacts: directories published atomically with a checksummed manifest."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openbook.storage.artifacts import (
    TMP_MARK,
    checksum_files,
    clean_stale_partials,
    partial_dir,
    publish,
    replace_file,
    sha256_file,
    staging_dir,
    verify_files,
)

MANIFEST = "manifest.json"


def _write_version(tmp: Path, content: str) -> dict[str, str]:
    (tmp / "sub").mkdir()
    (tmp / "weights.bin").write_text(content)
    (tmp / "sub" / "config.json").write_text("{}")
    return {rel: d.sha256 for rel, d in checksum_files(tmp).items()}


def _siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_checksums_and_verification_catch_corruption(tmp_path: Path) -> None:
    d = tmp_path / "a"
    d.mkdir()
    sums = _write_version(d, "v1")
    (d / MANIFEST).write_text("{}")
    digests = checksum_files(d, exclude={MANIFEST})
    assert list(digests) == ["sub/config.json", "weights.bin"]
    assert digests["weights.bin"].size == 2
    assert digests["weights.bin"].sha256 == hashlib.sha256(b"v1").hexdigest()
    assert sha256_file(d / "weights.bin") == sums["weights.bin"]
    sizes = {rel: x.size for rel, x in digests.items()}
    assert verify_files(d, sizes=sizes, sha256=sums) is None

    (d / "weights.bin").write_text("v2")  # same size, other bytes
    assert verify_files(d, sizes=sizes) is None  # sizes alone cannot tell
    problem = verify_files(d, sizes=sizes, sha256=sums)
    assert problem is not None and (problem.rel, problem.kind) == ("weights.bin", "checksum")
    assert str(problem) == "weights.bin checksum mismatch"

    (d / "weights.bin").write_text("longer")
    problem = verify_files(d, sizes=sizes, sha256=sums)
    assert problem is not None and problem.kind == "size"
    assert str(problem) == "weights.bin size 6 != 2 recorded in manifest"

    (d / "sub" / "config.json").unlink()
    problem = verify_files(d, sha256=sums)
    assert problem is not None and str(problem) == "sub/config.json missing"


def test_publish_is_atomic_and_writes_the_manifest_inside(tmp_path: Path) -> None:
    final = tmp_path / "model"
    seen: dict[str, object] = {}

    def before_rename(staging: Path) -> None:
        seen["final exists"] = final.exists()
        seen["manifest"] = (staging / MANIFEST).read_text()

    with staging_dir(final) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".model{TMP_MARK}")
        sums = _write_version(tmp, "v1")
        assert not final.exists()  # nothing under the final name while building
        publish(tmp, final, manifests={MANIFEST: str(sums)}, before_rename=before_rename)
    assert seen == {"final exists": False, "manifest": str(sums)}
    assert _siblings(tmp_path) == ["model"]  # no partial left beside it
    assert (final / "weights.bin").read_text() == "v1"
    assert (final / MANIFEST).read_text() == str(sums)
    assert verify_files(final, sha256=sums) is None


def test_publish_follows_the_durability_rules_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "out"
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:  # type: ignore[no-untyped-def]
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    with staging_dir(final) as tmp:
        _write_version(tmp, "v1")
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        publish(tmp, final, manifests={MANIFEST: "{}"})
        staged = str(tmp)
    monkeypatch.undo()

    def at(kind: str, path: str) -> int:
        return events.index((kind, os.path.realpath(path) if kind == "fsync" else path))

    files = [at("fsync", f"{staged}/{rel}") for rel in ("weights.bin", "sub/config.json")]
    manifest = at("fsync", f"{staged}/{MANIFEST}")
    staged_dir = at("fsync", staged)
    renamed = at("rename", str(final))
    parent = at("fsync", str(tmp_path))
    assert max(files) < manifest < staged_dir < renamed < parent


def test_publish_replaces_an_old_version_or_refuses(tmp_path: Path) -> None:
    final = tmp_path / "idx"
    for content in ("v1", "v2"):
        with staging_dir(final) as tmp:
            _write_version(tmp, content)
            publish(tmp, final, manifests={MANIFEST: content}, replace=True)
    assert (final / MANIFEST).read_text() == "v2" and _siblings(tmp_path) == ["idx"]

    with staging_dir(final) as tmp:
        _write_version(tmp, "v3")
        with pytest.raises(FileExistsError):
            publish(tmp, final, manifests={MANIFEST: "v3"})
    assert (final / MANIFEST).read_text() == "v2" and _siblings(tmp_path) == ["idx"]


def test_a_failure_before_the_rename_keeps_the_old_version(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    with staging_dir(final) as tmp:
        _write_version(tmp, "old")
        publish(tmp, final, manifests={MANIFEST: "old"})

    def fail(_: Path) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"), staging_dir(final) as tmp:
        _write_version(tmp, "new")
        publish(tmp, final, manifests={MANIFEST: "new"}, replace=True, before_rename=fail)
    assert (final / "weights.bin").read_text() == "old"
    assert _siblings(tmp_path) == ["ckpt"]  # the staging directory was removed


# A writer that dies (no cleanup runs) just before its rename.
_CRASHING_WRITER = """
import os, sys
from pathlib import Path
from openbook.storage.artifacts import publish, staging_dir

final = Path(sys.argv[1])
with staging_dir(final) as tmp:
    (tmp / "weights.bin").write_text("new")
    publish(tmp, final, manifests={"manifest.json": "new"}, replace=True,
            before_rename=lambda _: os._exit(3))
"""


def test_a_crash_before_the_rename_keeps_the_old_version_and_its_partial_is_cleaned(
    tmp_path: Path,
) -> None:
    final = tmp_path / "ckpt"
    with staging_dir(final) as tmp:
        _write_version(tmp, "old")
        publish(tmp, final, manifests={MANIFEST: "old"})
    (tmp_path / "other").mkdir()
    other_partial = tmp_path / f".other{TMP_MARK}somewhere-1-0123abcd"
    other_partial.mkdir()

    crashed = subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(final)], check=False)
    assert crashed.returncode == 3
    assert (final / "weights.bin").read_text() == "old"
    assert (final / MANIFEST).read_text() == "old"
    (partial,) = tmp_path.glob(f".ckpt{TMP_MARK}*")
    assert (partial / MANIFEST).read_text() == "new"  # complete, but never published

    assert clean_stale_partials(tmp_path, name="ckpt") == []  # within the grace period
    assert clean_stale_partials(tmp_path, name="ckpt", grace_s=0) == [partial]
    assert _siblings(tmp_path) == [other_partial.name, "ckpt", "other"]  # only its own


def test_a_live_writers_partial_is_kept(tmp_path: Path) -> None:
    final = tmp_path / "shards"
    with staging_dir(final) as tmp:
        (tmp / "a").write_text("x")
        assert clean_stale_partials(tmp_path, grace_s=0) == []  # its flock is held
    assert not tmp.exists()  # never published: removed at the end of the block
    assert partial_dir(final) == tmp_path / ".shards.partial"
    assert clean_stale_partials(tmp_path / "missing") == []


def test_replace_file_is_atomic(tmp_path: Path) -> None:
    pointer = tmp_path / "latest"
    replace_file(pointer, "step-000001\n")
    replace_file(pointer, "step-000002\n")
    assert pointer.read_text() == "step-000002\n"
    assert _siblings(tmp_path) == ["latest"]
