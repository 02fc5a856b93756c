"""The format of fine-tuned RAG checkpoints: layout, manifest, atomic publish, find, verify.

This module knows where each part of a checkpoint lives and what its manifest says; it never
loads a model, and imports neither torch nor :mod:`openbook.rag` / :mod:`openbook.index` (the
gateway imports the core without them). What reads and writes the parts sits beside what it
composes: the generator in :mod:`openbook.rag.checkpoint`, the query encoder in
:mod:`openbook.index.checkpoint`, a whole checkpoint (both, plus the trainer's state) in
:mod:`openbook_trainer.checkpoints`.

Layout of one checkpoint (``<root>/step-000120/``)::

    generator/        Hugging Face model + tokenizer (safetensors), loadable by RagGenerator.load,
                      + openbook_seq2seq.json / question_encoder_tokenizer/ or openbook_prompt.json
    generator_adapter/  instead of generator/, when only a LoRA adapter was trained: peft's files
                      + openbook_adapter.json naming the base model it applies to
                      (openbook.rag.adapters); a few MB instead of the whole model
    query_encoder/    Encoder.save output (safetensors + openbook_encoder.json), if trained
    query_encoder_adapter/  instead of query_encoder/, when only a LoRA adapter of it was
                      trained: peft's files + openbook_adapter.json naming the base encoder
                      (loaded by openbook.index.load_encoder); hundreds of KB
    trainer_state.pt  optimizer / scheduler / RNG state for ``--resume`` (optional)
    manifest.json     written last: what this is, and the sha256 of every other file

A checkpoint is assembled under a hidden temporary name in ``root`` and renamed into place only
when complete, by the rules of :mod:`openbook.storage.artifacts` (fsync, manifest, rename, fsync),
so a crash never leaves a directory that looks like a checkpoint. ``root/latest`` is a one-line file
naming the newest checkpoint, replaced atomically (:func:`openbook.storage.artifacts.replace_file`),
so readers see either the old or the new pointer, never a partial one.

Temporary names are ``.<name>.tmp-<machine>-<pid>-<random>``, and the writer holds an
exclusive ``flock`` on its temporary directory while it works, so
:func:`openbook.storage.artifacts.clean_stale_partials` can tell what a killed writer left behind
from what a live one (another trainer on the same root) is still writing. Hidden names are never
checkpoints: ``latest`` cannot name one and :func:`checkpoint_in_root` refuses them.

Services load only what :func:`checkpoint_in_root` allows: a checkpoint inside their
checkpoint root, after resolving symlinks and ``..``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from openbook.errors import InvalidArgument
from openbook.storage.artifacts import (
    checksum_files,
    publish,
    replace_file,
    staging_dir,
    verify_files,
)
from openbook.validation.limits import check_checkpoint_name

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
GENERATOR_DIR = "generator"
GENERATOR_ADAPTER_DIR = "generator_adapter"
QUERY_ENCODER_DIR = "query_encoder"
QUERY_ENCODER_ADAPTER_DIR = "query_encoder_adapter"
TRAINER_STATE = "trainer_state.pt"
GENERATOR_VERSION_FILE = "openbook_manifest.json"  # read by openbook.rag.loading.model_version
_PREFIX = "step-"
# Files a model directory must hold for the checkpoint to be usable at all.
_REQUIRED_MODEL_FILES = ("config.json",)
_REQUIRED_ADAPTER_FILES = ("adapter_config.json", "openbook_adapter.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt; the message names the offending file."""


class CheckpointPathError(CheckpointError):
    """A requested checkpoint is not inside the checkpoint root, or names a partial one."""


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


def generator_dir(ckpt: Path) -> Path:
    return Path(ckpt) / GENERATOR_DIR


def generator_adapter_dir(ckpt: Path) -> Path | None:
    d = Path(ckpt) / GENERATOR_ADAPTER_DIR
    return d if d.is_dir() else None


def query_encoder_dir(ckpt: Path) -> Path | None:
    """Where a checkpoint's query encoder is: the whole encoder or its adapter, both of which
    :func:`openbook.index.load_encoder` loads; None when it has none."""
    for name in (QUERY_ENCODER_DIR, QUERY_ENCODER_ADAPTER_DIR):
        d = Path(ckpt) / name
        if d.is_dir():
            return d
    return None


def query_encoder_adapter_dir(ckpt: Path) -> Path | None:
    d = Path(ckpt) / QUERY_ENCODER_ADAPTER_DIR
    return d if d.is_dir() else None


def trainer_state_path(ckpt: Path) -> Path | None:
    p = Path(ckpt) / TRAINER_STATE
    return p if p.is_file() else None


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint's manifest says of how it was made (:class:`CheckpointManifest`'s
    fields that its writer gives; the version, time and checksums are the publisher's)."""

    base_generator: str
    base_query_encoder: str | None
    index: Mapping[str, str]
    data_sha256: str
    metrics: Mapping[str, float] | None = None
    trained: list[str] | None = None
    config: Mapping[str, Any] | None = None


def publish_checkpoint(
    root: Path,
    step: int,
    fill: Callable[[Path], None],
    record: CheckpointRecord,
    *,
    keep_last: int | None = None,
    _before_rename: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``root/step-XXXXXX`` atomically, point ``root/latest`` at it, return its path.

    ``fill(tmp)`` writes the checkpoint's parts (the generator, the query encoder, the trainer
    state: see :func:`openbook_trainer.checkpoints.write_checkpoint`) into the hidden temporary
    directory; this module then writes the manifest, which checksums every file ``fill`` wrote,
    and renames the directory into place, ``record`` giving the manifest's other fields.
    ``keep_last`` deletes all but the newest N checkpoints after ``latest`` moved.
    ``_before_rename`` is a test hook called with the complete temporary directory.
    """
    root = Path(root)
    name = version_name(step)
    final = root / name
    # Held under its writer's flock until the end: tells clean_stale_partials it is in use.
    with staging_dir(final) as tmp:
        fill(tmp)
        manifest = CheckpointManifest(
            version=name,
            step=int(step),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            base_generator=str(record.base_generator),
            base_query_encoder=(
                None if record.base_query_encoder is None else str(record.base_query_encoder)
            ),
            index={str(k): str(v) for k, v in record.index.items()},
            data_sha256=record.data_sha256,
            metrics={k: float(v) for k, v in (record.metrics or {}).items()},
            files={rel: d.sha256 for rel, d in checksum_files(tmp, exclude={MANIFEST}).items()},
            trained=list(record.trained or []),
            config=_jsonable(dict(record.config or {})),
        )
        # Re-saving a step (after a resume) replaces it.
        publish(
            tmp,
            final,
            manifests={MANIFEST: manifest.to_json()},
            replace=True,
            before_rename=_before_rename,
        )
    replace_file(root / LATEST, name + "\n")
    if keep_last is not None and keep_last > 0:
        _prune(root, keep=keep_last, protect=name)
    return final


def _prune(root: Path, keep: int, protect: str) -> None:
    done = sorted(p for p in root.glob(f"{_PREFIX}*") if (p / MANIFEST).is_file())
    for old in done[:-keep]:
        if old.name != protect:
            shutil.rmtree(old, ignore_errors=True)


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


_NOT_INSIDE = (
    "checkpoint: not inside the checkpoint root (OPENBOOK_CHECKPOINT_DIR); give a version "
    "such as step-000120 or a path under the root"
)


def _inside(root: Path, path: Path) -> Path:
    """``path`` relative to ``root`` (both resolved), refusing anything outside or hidden."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        # The same words whatever is (or is not) at that path: a reload request must not
        # become a way to probe the file system outside the root.
        raise CheckpointPathError(_NOT_INSIDE) from None
    if any(part.startswith(".") for part in rel.parts):
        raise CheckpointPathError(
            f"checkpoint {rel.as_posix()!r}: a hidden or partial (.tmp-) entry, not a checkpoint"
        )
    return rel


def checkpoint_in_root(root: Path | None, requested: str | os.PathLike[str] | None) -> Path:
    """The checkpoint a reload request names, confined to the checkpoint ``root``.

    ``requested`` is empty (the checkpoint ``root/latest`` names), a version or path relative
    to ``root`` (``step-000120``), or an absolute path inside ``root``. Symlinks and ``..``
    are resolved before the check, and again for the checkpoint ``latest`` leads to, so no
    link leads outside. A path outside gets one fixed message, whatever is there; hidden
    entries (partial ``.tmp-`` writes) and names with control characters are refused.
    Returns the resolved checkpoint directory, not yet verified; raises
    :class:`CheckpointPathError` or :class:`CheckpointError`.
    """
    text = os.fspath(requested) if requested else ""
    try:  # the one gate of every name a reload brings: an RPC's, the desired model in Redis
        check_checkpoint_name("checkpoint", text)
    except InvalidArgument as exc:
        raise CheckpointPathError(str(exc)) from None
    if root is None:
        raise CheckpointPathError("checkpoint: no checkpoint root configured")
    real_root = Path(os.path.realpath(root))
    try:
        # An absolute ``requested`` replaces the root in the join; a relative one is under it.
        target = Path(os.path.realpath(real_root / text)) if text else real_root
    except (OSError, ValueError):  # a NUL byte, a path the OS refuses to resolve
        raise CheckpointPathError(_NOT_INSIDE) from None
    rel = _inside(real_root, target)
    if rel == Path(LATEST):
        target, rel = real_root, Path()
    if not target.is_dir():
        if rel == Path():
            raise CheckpointError("checkpoint: the checkpoint root holds no checkpoint yet")
        raise CheckpointError(f"checkpoint {rel.as_posix()!r} not found in the checkpoint root")
    if (target / MANIFEST).is_file():
        return target
    latest = latest_checkpoint(target)
    if latest is None:
        where = "the checkpoint root" if rel == Path() else repr(rel.as_posix())
        raise CheckpointError(
            f"checkpoint: {where} is neither a checkpoint nor holds a '{LATEST}' file"
        )
    real = Path(os.path.realpath(latest))
    _inside(real_root, real)
    return real


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
    problem = verify_files(path, sha256=manifest.files)
    if problem is not None and problem.kind == "checksum":
        raise CheckpointError(f"{label}: {problem.rel} is corrupt (sha256 mismatch)")
    if problem is not None:
        raise CheckpointError(f"{label}: {problem}")
    adapter = (path / GENERATOR_ADAPTER_DIR).is_dir()
    if not adapter and not (path / GENERATOR_DIR).is_dir():
        raise CheckpointError(f"{label}: {GENERATOR_DIR}/ missing")
    if (path / QUERY_ENCODER_DIR).is_dir() and (path / QUERY_ENCODER_ADAPTER_DIR).is_dir():
        raise CheckpointError(
            f"{label}: holds both {QUERY_ENCODER_DIR}/ and {QUERY_ENCODER_ADAPTER_DIR}/"
        )
    for sub in (GENERATOR_DIR, GENERATOR_ADAPTER_DIR, QUERY_ENCODER_DIR, QUERY_ENCODER_ADAPTER_DIR):
        d = path / sub
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*")):
            rel = p.relative_to(path).as_posix()
            if p.is_file() and rel not in manifest.files:
                raise CheckpointError(f"{label}: {rel} is not listed in {MANIFEST}")
        required = (
            _REQUIRED_ADAPTER_FILES
            if sub in (GENERATOR_ADAPTER_DIR, QUERY_ENCODER_ADAPTER_DIR)
            else _REQUIRED_MODEL_FILES
        )
        for req in required:
            if f"{sub}/{req}" not in manifest.files:
                raise CheckpointError(f"{label}: {sub}/{req} missing")
        if not any(
            rel.startswith(f"{sub}/") and rel.endswith(_WEIGHT_SUFFIXES) for rel in manifest.files
        ):
            raise CheckpointError(f"{label}: {sub}/ holds no weights file")
    return manifest


def open_checkpoint(path: Path, *, verify: bool = True) -> tuple[Path, CheckpointManifest]:
    """A checkpoint (or the latest one under a root): its directory and manifest, verified
    (:func:`verify_checkpoint`) unless ``verify=False`` (the caller just did, so only the
    manifest is read)."""
    ckpt = resolve_checkpoint(Path(path))
    return ckpt, verify_checkpoint(ckpt) if verify else read_manifest(ckpt)


def locate_in_root(root: Path | None, requested: str | None) -> tuple[str, str]:
    """The checkpoint a reload request names (confined as :func:`checkpoint_in_root`), as its
    path relative to the real root and its manifest's version; nothing is loaded or hashed.
    Replicas following a shared reload pin the relative path, which holds whatever path each
    replica mounts the root at."""
    path = checkpoint_in_root(root, requested)
    relative = path.relative_to(Path(os.path.realpath(root))).as_posix()  # type: ignore[arg-type]
    try:
        version = read_manifest(path).version
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {relative!r}: unreadable manifest: {exc}") from None
    return relative, version
