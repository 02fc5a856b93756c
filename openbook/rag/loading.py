"""Recognise a generator directory and build the matching backend.

Supported layouts (all local; nothing is ever downloaded):

* plain BART (``config.json`` with an encoder-decoder ``model_type`` + tokenizer files),
* a RAG checkpoint saved by ``RagTokenForGeneration`` / ``RagSequenceForGeneration.save_pretrained``
  (``config.json`` with ``model_type: rag``; generator weights under the ``rag.generator.`` prefix
  of the weight file, generator tokenizer in ``generator_tokenizer/`` as
  ``RagTokenizer.save_pretrained`` writes; the question-encoder tokenizer in
  ``question_encoder_tokenizer/``, whose decoding of the question is what the generator reads, as
  in transformers' ``RagRetriever``). The question encoder half of the same directory is loaded by
  the retriever (:mod:`openbook.index.rag_encoder`),
* a causal LM with an ``openbook_prompt.json``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
)

from openbook.config.settings import PRECISIONS
from openbook.errors import InvalidArgument
from openbook.rag.attention import use_matmul_attention
from openbook.rag.backends import CausalBackend, GeneratorBackend, seq2seq_backend
from openbook.rag.errors import ModelLoadError
from openbook.rag.prompting import (
    PROMPT_FILE,
    SEQ2SEQ_FILE,
    PromptSpec,
    load_seq2seq_settings,
    read_json,
)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")
MANIFEST_FILES = ("openbook_manifest.json", "manifest.json")
# Written by `openbook demo prepare` (openbook_trainer.demo.models): every file's size and sha256.
PREPARED_MANIFEST = "openbook_model.json"
RAG_GENERATOR_PREFIX = "rag.generator."
RAG_QUESTION_TOKENIZER_DIR = "question_encoder_tokenizer"
_DTYPES = {name: getattr(torch, dtype) for name, dtype in PRECISIONS.items() if dtype != "auto"}


@dataclass
class Loaded:
    backend: GeneratorBackend
    model_type: str
    version: str
    generation: dict[str, Any]  # decoding defaults from the model's generation config
    # Passages to retrieve when a request names none: a RAG checkpoint's n_docs; 0: no preference
    default_k: int = 0


AUTO = "auto"  # the hardware policy, resolve_device_dtype


def cpu_has_native_bf16() -> bool:
    """Whether this processor does bfloat16 arithmetic in hardware (x86 AVX512-BF16 or AMX-BF16,
    Arm's BF16 extension), so that bf16 weights compute faster than float32 rather than being
    widened to float32 for every operation. torch's CPU feature probe where it has one, else
    the kernel's flags in ``/proc/cpuinfo``."""
    flags = {"avx512_bf16", "amx_bf16", "bf16", "sve_bf16"}
    get_capabilities = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if get_capabilities is not None:
        try:
            caps = get_capabilities()
            return any(bool(caps.get(flag, False)) for flag in flags)
        except Exception:  # noqa: BLE001 - a failed probe falls back to /proc/cpuinfo
            pass
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and flags & set(value.split()):
            return True
    return False


def auto_dtype(device: str) -> torch.dtype:
    """The precision policy ("auto"): on CUDA bf16, or fp16 on a GPU without bf16; on the CPU
    bf16 only where the processor computes it natively (:func:`cpu_has_native_bf16`), else
    float32 (emulated bf16 is slower than float32 and no smaller in working memory)."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_device_dtype(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """The device (None: CUDA when present, else the CPU) and the weights' precision.

    ``dtype`` is one of :data:`_DTYPES`' names, ``"auto"`` (:func:`auto_dtype`, the generator
    service's policy) or None, the library default that tests and training rely on for exact
    results: float32 on the CPU whatever it supports, the CUDA policy on a GPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    name = None if dtype is None else str(dtype).strip().lower()
    if name is None:
        return device, auto_dtype(device) if device.startswith("cuda") else torch.float32
    if name == AUTO:
        return device, auto_dtype(device)
    try:
        return device, _DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            f"dtype must be {AUTO!r} or one of {sorted(_DTYPES)}, got {dtype!r}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load(path: str | Path, device: str | None, dtype: str | None) -> Loaded:
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist")
    dev, torch_dtype = resolve_device_dtype(device, dtype)
    config = read_json(root / "config.json")
    model_type = config.get("model_type")
    if model_type == "rag":
        backend, gen = _load_rag(root, config, dev, torch_dtype)
    elif config.get("is_encoder_decoder") or model_type in ("bart", "mbart", "t5"):
        backend, gen = _load_seq2seq(root, dev, torch_dtype)
    elif not _is_causal_lm(model_type):
        raise ModelLoadError(
            f"{root / 'config.json'}: model_type {model_type!r} is not a generator: expected a "
            "BART-style encoder-decoder, a RAG checkpoint or a causal LM"
        )
    elif (root / PROMPT_FILE).exists():
        backend, gen = _load_causal(root, dev, torch_dtype)
    else:
        raise ModelLoadError(
            f"missing file {root / PROMPT_FILE}: {root} holds a {model_type!r} model, which is "
            f"used as a causal LM generator and needs a prompt file"
        )
    backend.model.eval()
    use_matmul_attention(backend.model)  # CPU in bf16/fp16 only (openbook/rag/attention.py)
    default_k = rag_n_docs(config) or _saved_n_docs(root)
    return Loaded(backend, backend.kind, model_version(root), gen, default_k)


MAX_DEFAULT_K = 100  # the most passages a request may ask for


def rag_n_docs(config: dict) -> int:
    """A RAG checkpoint's ``n_docs`` (the passages it marginalises over, at most 100); 0 for
    any other model, or an ``n_docs`` that is not a positive integer (no preference)."""
    n_docs = config.get("n_docs") if config.get("model_type") == "rag" else None
    if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
        return 0
    return min(n_docs, MAX_DEFAULT_K)


def model_version(root: Path) -> str:
    """Manifest ``version`` if present; else dir name + a hash of the files' sha256 where a
    prepared model's manifest lists them (the same weights give the same version, however
    often they are re-prepared); else dir name + hash of file names, sizes and mtimes."""
    for name in MANIFEST_FILES:
        p = root / name
        if p.exists():
            version = read_json(p).get("version")
            if version:
                return str(version)
    h = hashlib.sha256()
    prepared = root / PREPARED_MANIFEST
    files = read_json(prepared).get("files") if prepared.exists() else None
    if isinstance(files, dict) and files:
        for rel in sorted(files):
            entry = files[rel]
            digest = entry.get("sha256", "") if isinstance(entry, dict) else ""
            h.update(f"{rel}:{digest}\n".encode())
        return f"{root.resolve().name}-{h.hexdigest()[:10]}"
    for p in sorted(root.rglob("*")):
        if p.is_file() and (p.suffix in (".json", ".safetensors", ".bin", ".model", ".txt")):
            st = p.stat()
            h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{root.resolve().name}-{h.hexdigest()[:10]}"


def _weights_file(root: Path) -> Path:
    for name in WEIGHT_FILES:
        if (root / name).exists():
            return root / name
    raise ModelLoadError(f"missing weights in {root}: expected one of {', '.join(WEIGHT_FILES)}")


def _check_weights(root: Path) -> None:
    """Open the weight file(s) early so a truncated/corrupt file is reported by name."""
    weights = _weights_file(root)
    files = [weights]
    if weights.name.endswith(".index.json"):
        index = read_json(weights)
        files = sorted({root / f for f in index.get("weight_map", {}).values()})
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"missing weights shard {f} (listed in {weights})")
    for f in files:
        _read_state_dict(f, header_only=True)


def _read_state_dict(path: Path, header_only: bool = False) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                if header_only:
                    return {}
                return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        if header_only:
            # a pickle can only be validated by reading it
            torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            return {}
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure means the file is unusable
        raise ModelLoadError(f"corrupt weights file {path}: {e}") from e


def _load_tokenizer(directory: Path):
    if not directory.is_dir():
        raise ModelLoadError(f"missing tokenizer directory {directory}")
    if not any((directory / f).exists() for f in TOKENIZER_FILES):
        raise ModelLoadError(
            f"missing tokenizer files in {directory}: expected one of {', '.join(TOKENIZER_FILES)}"
        )
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        if (directory / name).exists():
            read_json(directory / name)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load tokenizer from {directory}: {e}") from e


def _seq2seq_generation(gen: GenerationConfig | None) -> dict[str, Any]:
    if gen is None:
        return {}
    return {
        "forced_bos_token_id": gen.forced_bos_token_id,
        "forced_eos_token_id": gen.forced_eos_token_id,
        "no_repeat_ngram_size": gen.no_repeat_ngram_size or 0,
        "early_stopping": gen.early_stopping if gen.early_stopping is not None else False,
    }


def _load_model(
    auto: Any, what: str, root: Path, device: str, dtype: torch.dtype
) -> tuple[Any, Any]:
    """The model (``auto``: a transformers Auto class) and the tokenizer saved in ``root``,
    the model on ``device``; a :class:`ModelLoadError` saying it cannot load ``what``."""
    _check_weights(root)
    tokenizer = _load_tokenizer(root)
    try:
        model = auto.from_pretrained(str(root), dtype=dtype, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load {what} from {root}: {e}") from e
    model.to(device)
    return model, tokenizer


def _load_seq2seq(root: Path, device: str, dtype: torch.dtype) -> tuple[GeneratorBackend, dict]:
    model, tokenizer = _load_model(AutoModelForSeq2SeqLM, "seq2seq model", root, device, dtype)
    # Saved from a running backend (a checkpoint of a RAG generator): rebuild it as it was.
    settings = load_seq2seq_settings(root / SEQ2SEQ_FILE) if (root / SEQ2SEQ_FILE).exists() else {}
    q_dir = settings.get("question_tokenizer")
    backend = seq2seq_backend(
        model,
        tokenizer,
        prefix=settings.get("prefix", getattr(model.config, "prefix", None)),
        title_sep=settings.get("title_sep", " / "),
        doc_sep=settings.get("doc_sep", " // "),
        max_combined_length=settings.get("max_combined_length", 300),
        question_tokenizer=_load_tokenizer(root / q_dir) if q_dir else None,
    )
    return backend, _seq2seq_generation(model.generation_config)


def _is_causal_lm(model_type: object) -> bool:
    """Whether transformers has a causal-LM head for ``model_type`` (Gemma, Llama, GPT-2, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _saved_n_docs(root: Path) -> int:
    """``n_docs`` of a RAG generator saved from its running backend (``openbook_seq2seq.json``,
    see :func:`_load_seq2seq`), at most 100; 0 when there is none."""
    if not (root / SEQ2SEQ_FILE).exists():
        return 0
    return min(load_seq2seq_settings(root / SEQ2SEQ_FILE).get("n_docs", 0), MAX_DEFAULT_K)


def _load_rag(
    root: Path, config: dict, device: str, dtype: torch.dtype
) -> tuple[GeneratorBackend, dict]:
    gen_cfg = config.get("generator")
    if not isinstance(gen_cfg, dict) or "model_type" not in gen_cfg:
        raise ModelLoadError(f"corrupt file {root / 'config.json'}: RAG config without a generator")
    try:
        generator_config = AutoConfig.for_model(**gen_cfg)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(
            f"corrupt file {root / 'config.json'}: bad generator config: {e}"
        ) from e
    tok_dir = root / "generator_tokenizer"
    tokenizer = _load_tokenizer(tok_dir if tok_dir.is_dir() else root)
    # The generator reads the question as this tokenizer decodes it (Seq2SeqBackend.question_text)
    question_tokenizer = _load_tokenizer(root / RAG_QUESTION_TOKENIZER_DIR)

    weights = _weights_file(root)
    if weights.name.endswith(".index.json"):
        index = read_json(weights)
        shards = sorted({root / f for f in index.get("weight_map", {}).values()})
    else:
        shards = [weights]
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not shard.exists():
            raise ModelLoadError(f"missing weights shard {shard} (listed in {weights})")
        for key, value in _read_state_dict(shard).items():
            if key.startswith(RAG_GENERATOR_PREFIX):
                state[key[len(RAG_GENERATOR_PREFIX) :]] = value
    if not state:
        raise ModelLoadError(
            f"corrupt weights file {weights}: no '{RAG_GENERATOR_PREFIX}*' tensors"
        )

    model = AutoModelForSeq2SeqLM.from_config(generator_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    tied |= {"lm_head.weight", "final_logits_bias"}
    tied |= {k for k in missing if k.endswith("embed_tokens.weight")}
    real_missing = [k for k in missing if k not in tied]
    if real_missing or unexpected:
        raise ModelLoadError(
            f"corrupt weights file {weights}: generator tensors do not match its config "
            f"(missing {real_missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.tie_weights()
    model.to(device=device, dtype=dtype)

    if (root / "generation_config.json").exists():
        read_json(root / "generation_config.json")
        generation = GenerationConfig.from_pretrained(str(root), local_files_only=True)
    else:
        generation = GenerationConfig.from_model_config(config)
    backend = seq2seq_backend(
        model,
        tokenizer,
        prefix=config.get("prefix") or gen_cfg.get("prefix"),
        title_sep=config.get("title_sep", " / "),
        doc_sep=config.get("doc_sep", " // "),
        max_combined_length=int(config.get("max_combined_length", 300)),
        question_tokenizer=question_tokenizer,
    )
    return backend, _seq2seq_generation(generation)


def _load_causal(root: Path, device: str, dtype: torch.dtype) -> tuple[GeneratorBackend, dict]:
    spec = PromptSpec.load(root / PROMPT_FILE)
    model, tokenizer = _load_model(AutoModelForCausalLM, "causal LM", root, device, dtype)
    model.eval()
    try:
        backend = CausalBackend(model, tokenizer, spec)
    except ValueError as e:
        raise ModelLoadError(f"{root / PROMPT_FILE}: {e}") from e
    eos = model.generation_config.eos_token_id
    extra = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    return backend, {"extra_eos_token_ids": extra}
