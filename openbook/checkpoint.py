"""Fine-tuned RAG checkpoints: write atomically, find the latest, verify before loading.

Layout of one checkpoint (``<root>/step-000120/``)::

    generator/        Hugging Face model + tokenizer (safetensors), loadable by RagGenerator.load
    query_encoder/    Encoder.save output (safetensors + openbook_encoder.json), if trained
    trainer_state.pt  optimizer / scheduler / RNG state for ``--resume`` (optional)
    manifest.json     written last: what this is, and the sha256 of every other file

A checkpoint is assembled under a hidden temporary name in ``root`` and renamed into place only
when complete, so a crash never leaves a directory that looks like a checkpoint. ``root/latest``
is a one-line file naming the newest checkpoint, replaced with ``os.replace`` (atomic on POSIX),
so readers see either the old or the new pointer, never a partial one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
GENERATOR_DIR = "generator"
QUERY_ENCODER_DIR = "query_encoder"
TRAINER_STATE = "trainer_state.pt"
GENERATOR_VERSION_FILE = "openbook_manifest.json"  # read by openbook.rag.loading.model_version
_PREFIX = "step-"
_TMP_MARK = ".tmp-"
# Files a model directory must hold for the checkpoint to be usable at all.
_REQUIRED_MODEL_FILES = ("config.json",)
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt; the message names the offending file."""


@dataclass
class CheckpointManifest:
    """Contents of ``manifest.json``.

    ``index`` is ``{"name": ..., "checksum": ...}`` of the index the query encoder was trained
    against (its document vectors are frozen, so the encoder is only meaningful with it).
    ``files`` maps every other file's path relative to the checkpoint to its sha256.
    """

    version: str
    step: int
    created_at: str
    base_generator: str
    base_query_encoder: str | None
    index: dict[str, str]
    data_sha256: str
    metrics: dict[str, float] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    trained: list[str] = field(default_factory=list)  # "generator", "query_encoder"
    config: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_file(cls, path: Path) -> CheckpointManifest:
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path.parent}: {MANIFEST} missing")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            msg = f"checkpoint {path.parent}: {MANIFEST} unreadable ({e})"
            raise CheckpointError(msg) from None
        if not isinstance(data, dict):
            raise CheckpointError(f"checkpoint {path.parent}: {MANIFEST} is not a JSON object")
        if data.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {path.parent}: {MANIFEST} format_version "
                f"{data.get('format_version')!r} not supported (expected {FORMAT_VERSION})"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [
            n
            for n, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in data]
        if missing:
            raise CheckpointError(
                f"checkpoint {path.parent}: {MANIFEST} lacks field(s) {', '.join(missing)}"
            )
        if not isinstance(data.get("files"), dict) or not data["files"]:
            raise CheckpointError(f"checkpoint {path.parent}: {MANIFEST} lists no files")
        return cls(**{k: v for k, v in data.items() if k in fields})


def version_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> str:
    """One digest over several files' contents (names excluded, order kept)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(sha256_file(Path(p)).encode())
        h.update(b"\n")
    return h.hexdigest()


def generator_dir(ckpt: Path) -> Path:
    return Path(ckpt) / GENERATOR_DIR


def query_encoder_dir(ckpt: Path) -> Path | None:
    d = Path(ckpt) / QUERY_ENCODER_DIR
    return d if d.is_dir() else None


def trainer_state_path(ckpt: Path) -> Path | None:
    p = Path(ckpt) / TRAINER_STATE
    return p if p.is_file() else None


# ----------------------------------------------------------------------------- writing


def write_checkpoint(
    root: Path,
    step: int,
    *,
    query_encoder: Any | None,
    generator: Any,
    base_generator: str,
    base_query_encoder: str | None,
    index: Mapping[str, str],
    data_sha256: str,
    metrics: Mapping[str, float] | None = None,
    trained: list[str] | None = None,
    config: Mapping[str, Any] | None = None,
    trainer_state: Mapping[str, Any] | None = None,
    generator_source: Path | None = None,
    keep_last: int | None = None,
    _before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``root/step-XXXXXX`` atomically, point ``root/latest`` at it, return its path.

    ``generator`` is anything with ``save(dir)``, an object with ``.model`` and ``.tokenizer``
    (a RagGenerator backend), or a ``(model, tokenizer)`` pair. Files the HF ``save_pretrained``
    does not write but the loader reads (``openbook_*.json`` such as the causal-LM prompt) are
    copied from ``generator_source``, the directory the generator was loaded from.
    ``query_encoder`` is an :class:`openbook.index.Encoder` or None when it was not trained
    (the serving retriever then keeps the index's own query encoder).
    ``keep_last`` deletes all but the newest N checkpoints after ``latest`` moved.
    ``_before_rename`` is a test hook called with the complete temporary directory.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = version_name(step)
    final = root / name
    tmp = root / f".{name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _save_generator(generator, tmp / GENERATOR_DIR, generator_source)
        # RagGenerator.load reports this as its model_version, so /answer names the checkpoint.
        (tmp / GENERATOR_DIR / GENERATOR_VERSION_FILE).write_text(
            json.dumps({"version": name}) + "\n", encoding="utf-8"
        )
        if query_encoder is not None:
            query_encoder.save(tmp / QUERY_ENCODER_DIR)
        if trainer_state is not None:
            import torch

            torch.save(dict(trainer_state), tmp / TRAINER_STATE)
        files = {
            p.relative_to(tmp).as_posix(): sha256_file(p)
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        manifest = CheckpointManifest(
            version=name,
            step=int(step),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            base_generator=str(base_generator),
            base_query_encoder=None if base_query_encoder is None else str(base_query_encoder),
            index={str(k): str(v) for k, v in index.items()},
            data_sha256=data_sha256,
            metrics={k: float(v) for k, v in (metrics or {}).items()},
            files=files,
            trained=list(trained or []),
            config=_jsonable(dict(config or {})),
        )
        _write_durably(tmp / MANIFEST, manifest.to_json())
        _fsync_tree(tmp)
        if _before_rename is not None:
            _before_rename(tmp)
        if final.exists():
            # Re-saving a step (after a resume): move the old one aside first, since rename
            # cannot replace a non-empty directory.
            stale = root / f".{name}{_TMP_MARK}old-{uuid.uuid4().hex[:8]}"
            final.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _point_latest(root, name)
    if keep_last is not None and keep_last > 0:
        _prune(root, keep=keep_last, protect=name)
    return final


def _save_generator(generator: Any, out: Path, source: Path | None) -> None:
    if hasattr(generator, "save") and callable(generator.save):
        generator.save(out)
    else:
        if isinstance(generator, tuple):
            model, tokenizer = generator
        else:
            model, tokenizer = generator.model, generator.tokenizer
        backend = getattr(generator, "backend", generator)
        prefix = getattr(backend, "prefix", None)
        if prefix and not getattr(model.config, "prefix", None):
            # A generator loaded from a RAG checkpoint keeps its input prefix in the RAG config,
            # which a plain BART save would drop.
            model.config.prefix = prefix
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    if source is not None:
        for extra in Path(source).glob("openbook_*.json"):
            if extra.name != GENERATOR_VERSION_FILE and not (out / extra.name).exists():
                shutil.copy2(extra, out / extra.name)


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
    _write_durably(tmp, name + "\n")
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _prune(root: Path, keep: int, protect: str) -> None:
    done = sorted(p for p in root.glob(f"{_PREFIX}*") if (p / MANIFEST).is_file())
    for old in done[:-keep]:
        if old.name != protect:
            shutil.rmtree(old, ignore_errors=True)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


def _jsonable(value: Any) -> Any:
    """Config values as JSON: paths and other objects become strings."""
    return json.loads(json.dumps(value, default=str))


# ----------------------------------------------------------------------------- reading


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when nothing was written yet.

    Raises :class:`CheckpointError` when the pointer exists but names no checkpoint.
    """
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    if not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"{pointer}: does not name a checkpoint ({name!r})")
    path = root / name
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {name}, which is missing or incomplete")
    return path


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or the latest one under a checkpoint root."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: neither a checkpoint nor a root with a '{LATEST}' file")
    return latest


def read_manifest(path: Path) -> CheckpointManifest:
    """The manifest without hashing the files (cheap; use :func:`verify_checkpoint` to load)."""
    return CheckpointManifest.from_file(Path(path) / MANIFEST)


def verify_checkpoint(path: Path) -> CheckpointManifest:
    """Check that ``path`` is a complete, uncorrupted checkpoint and return its manifest.

    Every file the manifest lists must exist with the recorded sha256; no model file may be
    present that the manifest does not list (it would be loaded unchecked); the generator
    (and query encoder, if any) must have a config and weights.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: directory not found")
    manifest = CheckpointManifest.from_file(path / MANIFEST)
    label = f"checkpoint {manifest.version}"
    for rel, digest in sorted(manifest.files.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{label}: {rel} missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{label}: {rel} is corrupt (sha256 mismatch)")
    for sub in (GENERATOR_DIR, QUERY_ENCODER_DIR):
        d = path / sub
        if sub == GENERATOR_DIR and not d.is_dir():
            raise CheckpointError(f"{label}: {sub}/ missing")
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*")):
            rel = p.relative_to(path).as_posix()
            if p.is_file() and rel not in manifest.files:
                raise CheckpointError(f"{label}: {rel} is not listed in {MANIFEST}")
        for req in _REQUIRED_MODEL_FILES:
            if f"{sub}/{req}" not in manifest.files:
                raise CheckpointError(f"{label}: {sub}/{req} missing")
        if not any(
            rel.startswith(f"{sub}/") and rel.endswith(_WEIGHT_SUFFIXES) for rel in manifest.files
        ):
            raise CheckpointError(f"{label}: {sub}/ holds no weights file")
    return manifest


# ----------------------------------------------------------------------------- loading


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint's models, ready to serve or evaluate."""

    path: Path
    manifest: CheckpointManifest
    generator: Any  # openbook.rag.RagGenerator
    query_encoder: Any | None  # openbook.index.Encoder, None when the encoder was not trained

    @property
    def version(self) -> str:
        return self.manifest.version


def load_query_encoder(ckpt: Path, *, verify: bool = True) -> Any | None:
    """The checkpoint's query encoder (a private, uncached copy), or None if it has none."""
    from openbook.index import load_encoder

    ckpt = Path(ckpt)
    if verify:
        verify_checkpoint(ckpt)
    d = query_encoder_dir(ckpt)
    if d is None:
        return None
    try:
        return load_encoder(str(d), role="query", cached=False)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt.name}: {QUERY_ENCODER_DIR}/: {e}") from None


def load_checkpoint(
    path: Path, *, device: str | None = None, dtype: str | None = None
) -> LoadedCheckpoint:
    """Verify and load a checkpoint (or the latest one under a root).

    Raises :class:`CheckpointError` for anything missing or corrupt, including files the model
    loaders reject, so a server can keep its current model and report the message.
    """
    from openbook.rag import RagGenerator

    ckpt = resolve_checkpoint(Path(path))
    manifest = verify_checkpoint(ckpt)
    try:
        generator = RagGenerator.load(generator_dir(ckpt), device=device, dtype=dtype)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {manifest.version}: {GENERATOR_DIR}/: {e}") from None
    query_encoder = load_query_encoder(ckpt, verify=False)
    if query_encoder is not None and device is not None:
        query_encoder.model.to(device)
    return LoadedCheckpoint(ckpt, manifest, generator, query_encoder)
