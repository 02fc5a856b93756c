"""Fine-tuned RAG checkpoints: write atomically, find the latest, verify before loading.

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
when complete, by the rules of :mod:`openbook.artifacts` (fsync, manifest, rename, fsync), so a
crash never leaves a directory that looks like a checkpoint. ``root/latest`` is a one-line file
naming the newest checkpoint, replaced atomically (:func:`openbook.artifacts.replace_file`), so
readers see either the old or the new pointer, never a partial one.

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
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Marked F401: imported from here by the tests of checkpoints (they used to live here).
from openbook.artifacts import (
    PARTIAL_MAX_AGE_S,  # noqa: F401
    checksum_files,
    clean_stale_partials,  # noqa: F401
    publish,
    replace_file,
    staging_dir,
    verify_files,
)
from openbook.artifacts import machine_tag as _machine_tag  # noqa: F401
from openbook.errors import InvalidArgument
from openbook.limits import check_checkpoint_name

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


def write_checkpoint(
    root: Path,
    step: int,
    *,
    query_encoder: Any | None,
    generator: Any,
    base_generator: str,
    generator_adapter: TrainedAdapter | None = None,
    query_encoder_adapter: TrainedAdapter | None = None,
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
    ``generator_adapter``, when given, is saved instead of the whole generator
    (``generator_adapter/``): the LoRA adapter and the identity of the base it applies to.
    ``query_encoder_adapter`` likewise replaces ``query_encoder`` (``query_encoder_adapter/``,
    its base named by ``base_query_encoder``).
    ``keep_last`` deletes all but the newest N checkpoints after ``latest`` moved.
    ``_before_rename`` is a test hook called with the complete temporary directory.
    """
    root = Path(root)
    name = version_name(step)
    final = root / name
    # Held under its writer's flock until the end: tells clean_stale_partials it is in use.
    with staging_dir(final) as tmp:
        if generator_adapter is not None:
            from openbook.rag.adapters import save_adapter

            adapter = generator_adapter
            save_adapter(
                adapter.peft_model, tmp / GENERATOR_ADAPTER_DIR, adapter.base_id, base_generator
            )
        else:
            save_generator_dir(generator, tmp / GENERATOR_DIR, generator_source)
            # RagGenerator.load reports this as its model_version, so /answer names the
            # checkpoint.
            (tmp / GENERATOR_DIR / GENERATOR_VERSION_FILE).write_text(
                json.dumps({"version": name}) + "\n", encoding="utf-8"
            )
        if query_encoder_adapter is not None:
            from openbook.rag.adapters import save_adapter

            if base_query_encoder is None:
                raise ValueError("a query encoder adapter needs base_query_encoder")
            save_adapter(
                query_encoder_adapter.peft_model,
                tmp / QUERY_ENCODER_ADAPTER_DIR,
                query_encoder_adapter.base_id,
                str(base_query_encoder),
            )
        elif query_encoder is not None:
            query_encoder.save(tmp / QUERY_ENCODER_DIR)
        if trainer_state is not None:
            import torch

            torch.save(dict(trainer_state), tmp / TRAINER_STATE)
        manifest = CheckpointManifest(
            version=name,
            step=int(step),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            base_generator=str(base_generator),
            base_query_encoder=None if base_query_encoder is None else str(base_query_encoder),
            index={str(k): str(v) for k, v in index.items()},
            data_sha256=data_sha256,
            metrics={k: float(v) for k, v in (metrics or {}).items()},
            files={rel: d.sha256 for rel, d in checksum_files(tmp, exclude={MANIFEST}).items()},
            trained=list(trained or []),
            config=_jsonable(dict(config or {})),
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


@dataclass(frozen=True)
class TrainedAdapter:
    """A trained LoRA adapter to checkpoint: its ``peft`` model and its base's identity."""

    peft_model: Any
    base_id: str


def save_generator_dir(generator: Any, out: Path, source: Path | None) -> None:
    """A generator as a model directory that :meth:`openbook.rag.RagGenerator.load` loads: the
    weights and tokenizer, the backend settings it runs with, and ``openbook_*.json`` files of
    ``source`` (the directory it was loaded from) that are not rewritten."""
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
        # not the version, nor the demo's list of the source's file hashes: not these files
        skip = {GENERATOR_VERSION_FILE, "openbook_model.json"}
        for extra in Path(source).glob("openbook_*.json"):
            if extra.name not in skip and not (out / extra.name).exists():
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
        (out / PROMPT_FILE).write_text(spec.to_json(), encoding="utf-8")
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


def open_checkpoint(path: Path) -> tuple[Path, CheckpointManifest]:
    """A checkpoint (or the latest one under a root), verified: its directory and manifest."""
    ckpt = resolve_checkpoint(Path(path))
    return ckpt, verify_checkpoint(ckpt)


def _opened(path: Path, verify: bool) -> tuple[Path, CheckpointManifest]:
    if verify:
        return open_checkpoint(path)
    ckpt = resolve_checkpoint(Path(path))
    return ckpt, read_manifest(ckpt)


def load_generator(
    path: Path,
    *,
    device: str | None = None,
    dtype: str | None = None,
    verify: bool = True,
    base: Path | None = None,
) -> Any:
    """The generator of a checkpoint (or of the latest one under a root): an
    :class:`openbook.rag.RagGenerator` whose ``model_version`` is the checkpoint's version.

    A checkpoint that holds only an adapter (``generator_adapter/``) is loaded onto ``base``
    (default: the base model the trainer recorded) and merged into it; a base other than the
    one it was trained on is refused. The checkpoint is verified first unless ``verify=False``
    (the caller just did). Raises :class:`CheckpointError` for anything missing or corrupt,
    including files the model loader rejects, so a server can keep its current model and report
    the message.
    """
    from openbook.rag import RagGenerator

    ckpt, manifest = _opened(path, verify)
    adapter = generator_adapter_dir(ckpt)
    where = GENERATOR_ADAPTER_DIR if adapter is not None else GENERATOR_DIR
    try:
        if adapter is None:
            generator = RagGenerator.load(generator_dir(ckpt), device=device, dtype=dtype)
        else:
            base_dir = Path(base if base is not None else manifest.base_generator)
            generator = RagGenerator.load(base_dir, device=device, dtype=dtype)
            generator.apply_adapter(adapter, base_dir)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {manifest.version}: {where}/: {e}") from None
    generator.model_version = manifest.version
    return generator


def load_query_encoder(path: Path, *, device: str | None = None, verify: bool = True) -> Any | None:
    """The query encoder of a checkpoint (or of the latest one under a root), a private,
    uncached :class:`openbook.index.Encoder` on ``device`` (default: where it loads), or None
    when the checkpoint has none. An adapter (``query_encoder_adapter/``) is merged into the
    base encoder it names, which must be the one it was trained on. Verified first unless
    ``verify=False``; raises :class:`CheckpointError`."""
    from openbook.index import load_encoder

    ckpt, _ = _opened(path, verify)
    d = query_encoder_dir(ckpt)
    if d is None:
        return None
    try:
        encoder = load_encoder(str(d), role="query", cached=False)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt.name}: {d.name}/: {e}") from None
    if device is not None:
        encoder.model.to(device)
    return encoder


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The optimizer / scheduler / RNG state a checkpoint was saved with, on the CPU (the
    checkpoint is not verified again: :func:`open_checkpoint` first)."""
    import torch

    state_file = trainer_state_path(Path(path))
    if state_file is None:
        raise CheckpointError(f"{path} has no trainer state to resume from")
    return torch.load(state_file, map_location="cpu", weights_only=True)


def load_checkpoint(
    path: Path, *, device: str | None = None, dtype: str | None = None
) -> LoadedCheckpoint:
    """Verify a checkpoint (or the latest one under a root) once and load its models
    (:func:`load_generator`, :func:`load_query_encoder`); raises :class:`CheckpointError`."""
    ckpt, manifest = open_checkpoint(path)
    generator = load_generator(ckpt, device=device, dtype=dtype, verify=False)
    query_encoder = load_query_encoder(ckpt, device=device, verify=False)
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
