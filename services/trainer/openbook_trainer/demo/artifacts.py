"""Build a directory of files atomically, with a manifest that marks it complete.

The content is written into a temporary sibling directory, moved into place with one rename, and
only then is the manifest (file sizes and SHA-256 checksums) written, atomically: a directory
whose manifest is missing, of another format version, or disagrees with the files on disk is
incomplete and gets rebuilt. A lock file keeps two preparers from building the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Log = Callable[[str], None]


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_entries(root: Path, exclude: str) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` for every file under ``root`` but ``exclude``."""
    entries: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != exclude:
            entries[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return entries


def read_manifest(out_dir: Path, manifest_name: str) -> dict[str, Any] | None:
    try:
        raw = json.loads((out_dir / manifest_name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def is_complete(
    out_dir: Path,
    manifest_name: str,
    version: int,
    *,
    expect: dict[str, Any] | None = None,
    verify_checksums: bool = False,
) -> bool:
    """True if the manifest exists, has ``version`` and the ``expect`` entries, and every listed
    file has its size (and checksum, when ``verify_checksums``)."""
    manifest = read_manifest(out_dir, manifest_name)
    if manifest is None or manifest.get("version") != version:
        return False
    if any(manifest.get(k) != v for k, v in (expect or {}).items()):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for rel, entry in files.items():
        path = out_dir / rel
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return False
        if verify_checksums and sha256_file(path) != entry.get("sha256"):
            return False
    return True


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.chmod(0o644)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _make_readable(root: Path) -> None:
    """0644 files, 0755 dirs: some writers (safetensors) create files 0600, which would keep a
    service running as another user from reading a shared volume."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def build_atomically(
    out_dir: Path,
    build: Callable[[Path], dict[str, Any]],
    *,
    manifest_name: str,
    version: int,
    expect: dict[str, Any] | None = None,
    force: bool = False,
    log: Log = print,
) -> bool:
    """Make ``out_dir`` complete; return True if it was built, False if it already was.

    ``build(tmp_dir)`` writes the content into ``tmp_dir`` and returns the manifest's metadata;
    ``expect``, ``"version"`` and ``"files"`` are added to it. A directory whose manifest lacks
    one of the ``expect`` entries is rebuilt.
    """
    out_dir = out_dir.absolute()
    if not force and is_complete(out_dir, manifest_name, version, expect=expect):
        return False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir):
        if not force and is_complete(out_dir, manifest_name, version, expect=expect):
            return False  # another process finished it while we waited for the lock
        for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
        try:
            meta = build(tmp)
            _make_readable(tmp)
            files = file_entries(tmp, exclude=manifest_name)
            if out_dir.exists():
                log(f"replacing {'existing' if force else 'outdated or incomplete'} {out_dir}")
                old = out_dir.with_name(f".{out_dir.name}.partial-old")
                os.replace(out_dir, old)
                shutil.rmtree(old)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        manifest = {**meta, **(expect or {}), "version": version, "files": files}
        write_json_atomic(out_dir / manifest_name, manifest)
    return True
