"""Fine-tuned RAG checkpoints: write atomically, find the latest, verify before loading.

Layout of one checkpoint (``<root>/step-000120/``)::

    generator/        Hugging Face model + tokenizer (safetensors), loadable by RagGenerator.load,
                      + openbook_seq2seq.json / question_encoder_tokenizer/ or openbook_prompt.json
    query_encoder/    Encoder.save output (safetensors + openbook_encoder.json), if trained
    trainer_state.pt  optimizer / scheduler / RNG state for ``--resume`` (optional)
    manifest.json     written last: what this is, and the sha256 of every other file

A checkpoint is assembled under a hidden temporary name in ``root`` and renamed into place only
when complete, so a crash never leaves a directory that looks like a checkpoint. ``root/latest``
is a one-line file naming the newest checkpoint, replaced with ``os.replace`` (atomic on POSIX),
so readers see either the old or the new pointer, never a partial one.

Temporary names are ``.<name>.tmp-<machine>-<pid>-<random>``, and the writer holds an
exclusive ``flock`` on its temporary directory while it works, so
:func:`clean_stale_partials` can tell what a killed writer left behind from what a live one
(another trainer on the same root) is still writing. Hidden names are never checkpoints:
``latest`` cannot name one and :func:`checkpoint_in_root` refuses them.

Services load only what :func:`checkpoint_in_root` allows: a checkpoint inside their
checkpoint root, after resolving symlinks and ``..``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
GENERATOR_DIR = "generator"
QUERY_ENCODER_DIR = "query_encoder"
TRAINER_STATE = "trainer_state.pt"
GENERATOR_VERSION_FILE = "openbook_manifest.json"  # read by openbook.rag.loading.model_version
_PREFIX = "step-"
_TMP_MARK = ".tmp-"
# ``.<name>.tmp-<machine>-<pid>-<8 hex>``; older versions wrote names without the machine.
_TMP_OWNER = re.compile(r"\.tmp-(?P<machine>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]{8}$")
# A writer takes its lock right after creating its directory; younger entries are never
# judged by their lock, so that instant cannot make a live writer's directory look abandoned.
PARTIAL_GRACE_S = 30.0
# Where the lock says nothing (another machine on a shared volume, a file system without
# flock, a name without an owner), an entry untouched this long is abandoned.
PARTIAL_MAX_AGE_S = 24 * 3600.0
# Files a model directory must hold for the checkpoint to be usable at all.
_REQUIRED_MODEL_FILES = ("config.json",)
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
    (a RagGenerator backend), or a ``(model, tokenizer)`` pair. What the HF ``save_pretrained``
    does not write but the loader needs to rebuild the same backend is written from the running
    backend: a seq2seq backend's input format (``openbook_seq2seq.json``: a RAG checkpoint's
    prefix, title_sep, doc_sep, max_combined_length, n_docs) and question-encoder tokenizer
    (``question_encoder_tokenizer/``), a causal LM's ``openbook_prompt.json``. Other
    ``openbook_*.json`` files are copied from ``generator_source``, the directory the generator
    was loaded from, where it still exists. All of them are checksummed in the manifest.
    ``query_encoder`` is an :class:`openbook.index.Encoder` or None when it was not trained
    (the serving retriever then keeps the index's own query encoder).
    ``keep_last`` deletes all but the newest N checkpoints after ``latest`` moved.
    ``_before_rename`` is a test hook called with the complete temporary directory.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = version_name(step)
    final = root / name
    tmp = _tmp_path(root, name)
    tmp.mkdir()
    lock: int | None = None
    try:
        # Held until the end: tells clean_stale_partials that this directory is in use.
        lock = _hold_writer_lock(tmp)
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
            stale = _tmp_path(root, name)
            final.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)
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
        _save_backend_settings(generator, backend, out)
    if source is not None:
        for extra in Path(source).glob("openbook_*.json"):
            if extra.name != GENERATOR_VERSION_FILE and not (out / extra.name).exists():
                shutil.copy2(extra, out / extra.name)


def _save_backend_settings(generator: Any, backend: Any, out: Path) -> None:
    """Write what the loader needs besides model + tokenizer to rebuild ``backend`` as it runs.

    Taken from the running backend, never from its source directory (which need not exist where
    the trainer runs): a seq2seq backend's input format (``openbook_seq2seq.json``) and its
    question-encoder tokenizer (a RAG checkpoint's, saved with ``save_pretrained``); a causal
    LM's prompt (``openbook_prompt.json``).
    """
    from openbook.rag.loading import RAG_QUESTION_TOKENIZER_DIR
    from openbook.rag.prompting import PROMPT_FILE, SEQ2SEQ_FILE, PromptSpec

    spec = getattr(backend, "spec", None)
    if isinstance(spec, PromptSpec):
        (out / PROMPT_FILE).write_text(
            json.dumps(dataclasses.asdict(spec), indent=2) + "\n", encoding="utf-8"
        )
        return
    if not all(hasattr(backend, a) for a in ("title_sep", "doc_sep", "max_combined_length")):
        return
    settings: dict[str, Any] = {
        "prefix": getattr(backend, "prefix", None),
        "title_sep": backend.title_sep,
        "doc_sep": backend.doc_sep,
        "max_combined_length": int(backend.max_combined_length),
        "question_tokenizer": None,
    }
    n_docs = getattr(generator, "default_k", None) or getattr(backend, "n_docs", None)
    if isinstance(n_docs, int) and not isinstance(n_docs, bool) and n_docs > 0:
        settings["n_docs"] = n_docs
    question_tokenizer = getattr(backend, "question_tokenizer", None)
    if question_tokenizer is not None:
        question_tokenizer.save_pretrained(out / RAG_QUESTION_TOKENIZER_DIR)
        settings["question_tokenizer"] = RAG_QUESTION_TOKENIZER_DIR
    (out / SEQ2SEQ_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _point_latest(root: Path, name: str) -> None:
    tmp = _tmp_path(root, LATEST)
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


# ----------------------------------------------------------------------------- partial writes


@functools.lru_cache(maxsize=1)
def _machine_tag() -> str:
    """This kernel: the Linux boot id (shared by every container on the machine, new after a
    reboot), else the host name. Only on the same kernel does a free flock prove a writer dead;
    pids alone cannot, since every container numbers its processes from 1."""
    try:
        raw = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        raw = socket.gethostname()
    return re.sub(r"[^A-Za-z0-9]", "", raw)[:32] or "unknown"


def _tmp_path(root: Path, name: str) -> Path:
    return root / f".{name}{_TMP_MARK}{_machine_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _hold_writer_lock(path: Path) -> int | None:
    """An exclusive flock on ``path``, held until the returned descriptor is closed (the kernel
    drops it when the writer dies, however it dies). None where the file system has no flock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _lock_is_free(path: Path) -> bool | None:
    """Whether no process holds ``path``'s flock; None when this cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)  # also releases the lock if it was taken
    return True


def _newest_mtime(path: Path) -> float:
    """The latest modification time of ``path`` and anything under it (links not followed)."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for parent, dirs, files in os.walk(path):
            for entry in (*dirs, *files):
                try:
                    newest = max(newest, os.lstat(os.path.join(parent, entry)).st_mtime)
                except OSError:
                    continue  # removed while we looked
    return newest


def _is_abandoned(path: Path, now: float, grace_s: float, max_age_s: float) -> bool:
    idle = now - _newest_mtime(path)
    if idle < grace_s:
        return False
    owner = _TMP_OWNER.search(path.name)
    free = _lock_is_free(path)
    if free is False:
        return False  # a live writer holds it
    if free and owner is not None and owner["machine"] == _machine_tag():
        return True  # written on this kernel, whose writer would hold the lock if it lived
    # Another machine (a lock there may be invisible here), no flock, or an old-style name.
    return idle > max_age_s


def clean_stale_partials(
    root: Path, *, grace_s: float = PARTIAL_GRACE_S, max_age_s: float = PARTIAL_MAX_AGE_S
) -> list[Path]:
    """Remove what killed writers left in ``root`` (``.<name>.tmp-*`` directories and files);
    return what was removed.

    Safe beside live writers, also other trainers writing into the same root: an entry is
    removed when it was written on this machine and no process holds its writer lock, or,
    where the lock cannot tell (another machine, no flock, an old-style name), when nothing in
    it changed for ``max_age_s``. Entries younger than ``grace_s`` are always kept.
    """
    root = Path(root)
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    now = time.time()
    for path in entries:
        if not (path.name.startswith(".") and _TMP_MARK in path.name):
            continue
        try:
            if not _is_abandoned(path, now, grace_s, max_age_s):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue  # another cleaner (a second trainer starting) was faster
        except OSError as exc:
            log.warning("cannot remove partial checkpoint %s: %s", path, exc)
            continue
        log.info("removed partial checkpoint %s left by an interrupted writer", path.name)
        removed.append(path)
    return removed


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
    entries (partial ``.tmp-`` writes) are refused. Returns the resolved checkpoint
    directory, not yet verified; raises :class:`CheckpointPathError` or
    :class:`CheckpointError`.
    """
    if root is None:
        raise CheckpointPathError("checkpoint: no checkpoint root configured")
    real_root = Path(os.path.realpath(root))
    text = os.fspath(requested) if requested else ""
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
