"""What a request may ask for: every limit and text rule, defined once.

Each boundary checks a request once, against these, and turns it into a typed request that
the code behind it trusts: the gateway's HTTP schemas (``openbook_gateway.schemas``), the
retriever's ``Retrieve`` and index RPCs and the generator's ``Generate``. A request the gateway
accepts is therefore one the services accept. Decoding options have one rule,
:func:`check_decoding`, at all three of their boundaries: the gateway's schema, the generator's
``Generate`` and the library's entry (``DecodingOptions.validate``, for ``RagGenerator``'s
direct callers).

Torch-free and framework-free (the gateway imports it). The ``check_*`` functions raise
:class:`openbook.errors.InvalidArgument` (a ``ValueError``, so a pydantic validator reports it
as a 422 naming the field) with a message that starts with the field's name.
"""

from __future__ import annotations

import inspect
import math
import re
import unicodedata
from collections.abc import Mapping
from typing import Literal, TypeGuard, get_args

from openbook.errors import InvalidArgument

# How an answer is decoded (openbook.rag.options): RAG-Token, or RAG-Sequence with the
# thorough or fast approximation of the paper (§2.5).
DecodingMode = Literal["rag-token", "rag-sequence-thorough", "rag-sequence-fast"]
DECODING_MODES: tuple[str, ...] = get_args(DecodingMode)

# How passages are retrieved (openbook.index.fusion): the dense view (query encoder + FAISS),
# the BM25 view, or both fused into one score. A request that names none gets its index's
# default (Manifest.default_retrieval: "hybrid" where both views exist, dense for the
# paper's DPR / RAG encoders).
RetrievalMode = Literal["dense", "bm25", "hybrid"]
RETRIEVAL_MODES: tuple[str, ...] = get_args(RetrievalMode)
# The views of an index each mode reads.
RETRIEVAL_VIEWS: dict[str, tuple[str, ...]] = {
    "dense": ("dense",),
    "bm25": ("bm25",),
    "hybrid": ("dense", "bm25"),
}

# Characters in a question (code points): the gateway's question, each retriever query and
# the generator's question.
MAX_QUESTION_CHARS = 2000
# Conversations (openbook_gateway.conversation): a /v1 ``messages`` or ``input`` list, or
# /answer's ``history`` with its question, holds at most MAX_CONVERSATION_MESSAGES messages
# (more: refused naming the field). Of the turns before the question only the last
# CONVERSATION_USER_TURNS user messages and the last assistant message are read, each cut to
# CONVERSATION_TURN_CHARS characters; the question they expand (what retrieval and the
# generator get) is still at most MAX_QUESTION_CHARS, so a long conversation costs no more.
MAX_CONVERSATION_MESSAGES = 256
CONVERSATION_USER_TURNS = 2
CONVERSATION_TURN_CHARS = 300
# One message of /answer's history (an earlier question or answer; only its start is read).
MAX_HISTORY_MESSAGE_CHARS = 8192
# Passages per question: retrieved (k), and handed to the generator.
MAX_K = 100
# Queries in one Retrieve call.
MAX_QUERIES = 256
MAX_BEAMS = 16
# The n-best list returned is at most num_beams long.
MAX_RETURN_SEQUENCES = MAX_BEAMS
MAX_NEW_TOKENS = 512
MIN_LENGTH_PENALTY, MAX_LENGTH_PENALTY = -10.0, 10.0
# Sampling (openbook/rag/sampling.py): temperature 0 is greedy / beam search, (0, 2] samples
# (OpenAI's range); top_p in (0, 1] (1: off); top_k >= 0 (0: off; the proto's int32 bounds it);
# a seed is any signed 64-bit integer (the proto's int64).
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# An index is named by its directory under the index root. Python checks it with fullmatch:
# its "$" also matches before a trailing newline, so re.match would let "name\n" through
# (pydantic's regex engine reads "$" as the end of the text).
INDEX_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# A checkpoint named in a reload request (a version, or a path inside the checkpoint root).
MAX_CHECKPOINT_CHARS = 4096

# A document written into a live index (openbook.index.documents): its id names it in URLs
# (no "/"), its text is split into the paper's passages; metadata is a flat map of scalars.
MAX_DOCUMENT_ID_CHARS = 256
MAX_DOCUMENT_TITLE_CHARS = 1000
# About 150k words: an article, not a corpus (bulk loads go through batches).
MAX_DOCUMENT_TEXT_CHARS = 1_000_000
MAX_METADATA_KEYS = 64
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 4096
# The largest magnitude of an integer in metadata or a filter: 2**53 - 1 (JavaScript's
# Number.MAX_SAFE_INTEGER), below which every integer is exactly a float64. JSON has one number
# type, so 2018 and 2018.0 are one value; a larger integer is another number to a client that
# reads JSON numbers as doubles, and one past float64's range (10**400) is no float at all.
MAX_SAFE_INTEGER = 2**53 - 1
# A retrieval filter (openbook.validation.metadata_filter): conditions (key tests) in all, nesting
# of $and/$or, values of one $in, and the size of its JSON text (the retriever's filter_json).
MAX_FILTER_CONDITIONS = 64
MAX_FILTER_DEPTH = 8
MAX_FILTER_IN_VALUES = 1024
MAX_FILTER_JSON_CHARS = 65_536
# A key's rate (issue 43, openbook_gateway.key_limits): the most that can be asked for.
MAX_KEY_REQUESTS_PER_MINUTE = 1_000_000
MAX_KEY_CONCURRENT_GENERATIONS = 10_000
# Who asks the generator (GenerateRequest.caller, its fair share): a key's name fits.
MAX_CALLER_CHARS = 128
# Documents in one batch write (one version, all or nothing).
MAX_BATCH_DOCUMENTS = 1000
# A paged document (an uploaded PDF, issue 33) keeps the words of each of its pages in its
# metadata under this key, comma-separated ("312,290,0,405"): its passages are then cut page by
# page, so none spans two pages and each knows its page (what a citation names).
PAGE_WORDS_KEY = "page_words"

# The control characters a question may hold: people paste multi-line text.
QUESTION_CONTROLS = "\t\n\r"
CONTROL_NAMES = {"\t": "tab", "\n": "newline", "\r": "carriage return"}
# Characters that show nothing: a question made only of these is blank.
INVISIBLE = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})
# Code points that render as nothing though their category is a letter, mark or symbol:
# Unicode's Default_Ignorable_Code_Point outside Cc/Cf (the Hangul fillers, the combining
# grapheme joiner, variation selectors, Mongolian and Khmer inherent vowels) and the blank
# Braille pattern. Pairs of (first, last), inclusive.
_BLANK_RANGES = (
    (0x034F, 0x034F),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x2800, 0x2800),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFFA0, 0xFFA0),
    (0xE0100, 0xE01EF),
)


def is_invisible(char: str) -> bool:
    """Whether ``char`` shows nothing, or shows as something it is not: a control (Cc), a
    format character (Cf: zero-width spaces and joiners, bidi embeddings, overrides and
    isolates, the BOM, tags), a separator (Zs, Zl, Zp, the plain space included), a
    surrogate, or one of the blank code points above."""
    category = unicodedata.category(char)
    if category in INVISIBLE or category == "Cs":
        return True
    point = ord(char)
    return any(first <= point <= last for first, last in _BLANK_RANGES)


def refuse_invisible(field: str, value: str) -> str:
    """``value`` if every character of it shows as itself, but for plain spaces between
    others; else an error naming ``field`` and the first one that does not (issue 42: an id
    holding U+202E shows reversed, one holding U+200B looks like another).

    The rule for a name a person reads and types: a document id and a metadata key. Control
    characters are named as :func:`refuse_controls` names them (NUL first)."""
    refuse_controls(field, value)
    for at, char in enumerate(value):
        if char == " " or not is_invisible(char):
            continue
        name = unicodedata.name(char, "")
        what = f"U+{ord(char):04X}{' ' + name if name else ''} at index {at}"
        raise InvalidArgument(
            f"{field} must not contain invisible, format, bidi-control or separator "
            f"characters other than the space ({what})"
        )
    if value != value.strip(" "):
        raise InvalidArgument(f"{field} must not start or end with a space")
    return value


def has_visible(value: str) -> bool:
    """Whether ``value`` holds a character that shows (not only whitespace, controls, format
    or blank characters)."""
    return not all(char.isspace() or is_invisible(char) for char in value)


_INDEX_NAME = re.compile(INDEX_NAME_PATTERN)


def refuse_controls(field: str, value: str, allowed: str = "") -> str:
    """Return ``value``, or raise naming ``field`` and its first control character that is not
    in ``allowed``.

    NUL cuts strings short in C code, logs and paths; other control characters mean nothing
    to a tokenizer. (Lone surrogates never get this far: protobuf and pydantic refuse them.)
    """
    for at, char in enumerate(value):
        if unicodedata.category(char) != "Cc" or char in allowed:
            continue
        where = f"U+{ord(char):04X} at index {at}"
        if char == "\x00":
            raise InvalidArgument(f"{field} must not contain NUL characters ({where})")
        if allowed:
            where += "; allowed: " + ", ".join(CONTROL_NAMES.get(c, repr(c)) for c in allowed)
        raise InvalidArgument(f"{field} must not contain control characters ({where})")
    return value


def check_question(field: str, value: str) -> str:
    """A question (or retriever query): visible text of at most :data:`MAX_QUESTION_CHARS`
    characters, whose only control characters are tab, newline and carriage return."""
    if len(value) > MAX_QUESTION_CHARS:
        raise InvalidArgument(
            f"{field} must be at most {MAX_QUESTION_CHARS} characters, got {len(value)}"
        )
    if not has_visible(value):
        raise InvalidArgument(
            f"{field} must not be blank: it holds only whitespace, control or format characters"
        )
    return refuse_controls(field, value, QUESTION_CONTROLS)


def check_range(field: str, value: object, lo: int, hi: int) -> int:
    """``value``, an integer (not a bool) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{field} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{field} must be in [{lo}, {hi}], got {value}")
    return value


def is_finite_number(value: object) -> TypeGuard[float]:
    """An int or float (not a bool), neither infinite nor NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_finite(field: str, value: object) -> float:
    """``value``, a finite number (a passage's score)."""
    if not is_finite_number(value):
        raise InvalidArgument(f"{field} must be a finite number, got {value!r}")
    return float(value)


def check_index_name(field: str, value: str) -> str:
    """An index name (:data:`INDEX_NAME_PATTERN`), control characters named as such."""
    refuse_controls(field, value)
    if not _INDEX_NAME.fullmatch(value):
        raise InvalidArgument(
            f"{field} must be an index name (letters, digits, '.', '_' and '-', at most 128, "
            f"starting with a letter or digit), got {value!r}"
        )
    return value


def check_checkpoint_name(field: str, value: str) -> str:
    """A checkpoint a reload names (a version or a path inside the checkpoint root): at most
    :data:`MAX_CHECKPOINT_CHARS` characters, none of them a control character (no path a client
    means to send holds NUL or a newline)."""
    if len(value) > MAX_CHECKPOINT_CHARS:
        raise InvalidArgument(
            f"{field} must be at most {MAX_CHECKPOINT_CHARS} characters, got {len(value)}"
        )
    return refuse_controls(field, value)


def check_retrieval(field: str, value: str) -> str:
    """A retrieval mode: one of :data:`RETRIEVAL_MODES`."""
    if value not in RETRIEVAL_MODES:
        raise InvalidArgument(
            f"{field}: must be one of {', '.join(RETRIEVAL_MODES)}, got {value!r}"
        )
    return value


def check_retrieval_views(field: str, mode: str, index: str, views: tuple[str, ...]) -> str:
    """``mode`` (a valid retrieval mode) if index ``index``, holding ``views``, can serve it;
    else an error naming ``field``, the index and the views it has."""
    missing = [view for view in RETRIEVAL_VIEWS[mode] if view not in views]
    if missing:
        have = " and ".join(views) or "no"
        raise InvalidArgument(
            f"{field}: {mode!r} needs the {' and '.join(missing)} view; index {index!r} has "
            f"only the {have} view{'s' if len(views) > 1 else ''}"
        )
    return mode


def check_decoding(
    mode: str,
    num_beams: int,
    max_new_tokens: int,
    min_new_tokens: int,
    num_return_sequences: int,
    length_penalty: float,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
) -> None:
    """Decoding options: each of its type and in its range, and consistent with each other.
    The one definition of the rules (see the module's docstring for who calls it); the error
    names the first bad field.

    Sampling (``temperature`` > 0) draws every answer on its own: ``num_return_sequences``
    answers are that many independent samples, and ``num_beams`` must be 1 (beam search keeps
    the likeliest continuations, it does not sample). At temperature 0, ``top_p``, ``top_k``
    and ``seed`` are checked but change nothing (greedy's argmax lies in every top-k / top-p
    set)."""
    if mode not in DECODING_MODES:
        raise InvalidArgument(f"mode must be one of {list(DECODING_MODES)}, got {mode!r}")
    check_sampling(temperature, top_p, top_k, seed)
    num_beams = check_range("num_beams", num_beams, 1, MAX_BEAMS)
    max_new_tokens = check_range("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
    check_range("min_new_tokens", min_new_tokens, 0, max_new_tokens)
    if temperature > 0:
        if num_beams != 1:
            raise InvalidArgument(
                f"num_beams must be 1 when sampling (temperature {temperature} > 0): beam "
                f"search keeps the likeliest answers and does not sample, got {num_beams}"
            )
        check_range("num_return_sequences", num_return_sequences, 1, MAX_RETURN_SEQUENCES)
    else:
        check_range("num_return_sequences", num_return_sequences, 1, num_beams)
    if not (
        is_finite_number(length_penalty)
        and MIN_LENGTH_PENALTY <= length_penalty <= MAX_LENGTH_PENALTY
    ):
        raise InvalidArgument(
            f"length_penalty must be in [{MIN_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
            f"got {length_penalty!r}"
        )


def check_decoding_of(mode: str, options: object) -> None:
    """:func:`check_decoding` over the attributes of ``options`` named as its parameters (a
    ``DecodingOptions``, a request holding the same fields)."""
    check_decoding(mode, **{name: getattr(options, name) for name in _DECODING_FIELDS})


# check_decoding's parameters after the mode: the fields of the options it checks
_DECODING_FIELDS = tuple(inspect.signature(check_decoding).parameters)[1:]


def check_sampling(temperature: object, top_p: object, top_k: object, seed: object) -> None:
    """The sampling parameters, each in its range (:func:`check_decoding` calls it; a route
    that takes them under OpenAI's names reports the same message)."""
    if not (is_finite_number(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise InvalidArgument(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0: greedy or beam search), "
            f"got {temperature!r}"
        )
    if not (is_finite_number(top_p) and 0 < top_p <= 1):
        raise InvalidArgument(f"top_p must be in (0, 1] (1: no nucleus cut), got {top_p!r}")
    check_range("top_k", top_k, 0, MAX_TOP_K)
    if seed is not None:
        check_range("seed", seed, MIN_SEED, MAX_SEED)


# --- documents written into a live index -------------------------------------------------------
#
# The one definition of a document's rules: the gateway's schema and the library's Document
# (openbook.index.documents, the retriever's boundary) both call these.


def check_document_id(field: str, value: object, *, stored: bool = False) -> str:
    """A new document's id: a document reference (:func:`check_document_ref`) whose every
    character shows as itself (:func:`refuse_invisible`: no format, bidi-control or invisible
    characters, no separator but the plain space, none at its ends), so two ids that look
    alike are one id, and an id shows in a list as what it is.

    ``stored`` (here, in :func:`check_document_text` and :func:`check_metadata`): a document
    read back from a write-ahead log, held to the rules of before issue 42 (a reference's),
    so that one written then still loads, and can be read and deleted."""
    ref = check_document_ref(field, value)
    return ref if stored else refuse_invisible(field, ref)


def check_document_ref(field: str, value: object) -> str:
    """An id naming a document that may already exist (a read, a delete, a listing's
    cursor): a non-blank string of at most :data:`MAX_DOCUMENT_ID_CHARS` characters, without
    ``/`` (it is a URL path segment) or control characters. Laxer than
    :func:`check_document_id` only so that a document written before its rule (issue 42)
    can still be read and deleted."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{field} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidArgument(f"{field} must not be empty")
    if len(value) > MAX_DOCUMENT_ID_CHARS:
        raise InvalidArgument(
            f"{field} must be at most {MAX_DOCUMENT_ID_CHARS} characters, got {len(value)}"
        )
    if "/" in value:
        raise InvalidArgument(f"{field} must not contain '/' (it is a URL path segment)")
    return refuse_controls(field, value)


def check_document_title(field: str, value: object) -> str:
    """A document's title: at most :data:`MAX_DOCUMENT_TITLE_CHARS` characters, no control
    characters (it may be empty)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{field} must be a string, got {type(value).__name__}")
    if len(value) > MAX_DOCUMENT_TITLE_CHARS:
        raise InvalidArgument(
            f"{field} must be at most {MAX_DOCUMENT_TITLE_CHARS} characters, got {len(value)}"
        )
    return refuse_controls(field, value)


def check_document_text(field: str, value: object, *, stored: bool = False) -> str:
    """A document's text: at least one word and one visible character (:func:`has_visible`;
    ``stored``: see :func:`check_document_id`), at most :data:`MAX_DOCUMENT_TEXT_CHARS`
    characters, whose only control characters are tab, newline and carriage return."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{field} must be a string, got {type(value).__name__}")
    if len(value) > MAX_DOCUMENT_TEXT_CHARS:
        raise InvalidArgument(
            f"{field} must be at most {MAX_DOCUMENT_TEXT_CHARS} characters, got {len(value)}"
        )
    if not value.split():
        raise InvalidArgument(f"{field} must not be empty: it holds no words")
    if not stored and not has_visible(value):
        raise InvalidArgument(
            f"{field} must hold a visible character: it holds only whitespace, control, "
            "format or other invisible characters"
        )
    return refuse_controls(field, value, QUESTION_CONTROLS)


def parse_page_words(field: str, value: object) -> tuple[int, ...]:
    """A :data:`PAGE_WORDS_KEY` value: comma-separated word counts (>= 0), one per page."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{field} must be comma-separated word counts, one per page")
    counts = value.split(",")
    if not all(count.isascii() and count.isdigit() for count in counts):
        raise InvalidArgument(
            f"{field} must be comma-separated word counts, one per page, got {value[:40]!r}"
        )
    return tuple(int(count) for count in counts)


def check_integer(field: str, value: int) -> int:
    """``value`` (an int, not a bool) if its magnitude is at most :data:`MAX_SAFE_INTEGER`;
    else an error naming ``field`` (without the digits, which may be thousands)."""
    if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        return value
    raise InvalidArgument(
        f"{field} must be an integer from -{MAX_SAFE_INTEGER} to {MAX_SAFE_INTEGER} "
        f"(2**53 - 1), got one of {value.bit_length()} bits"
    )


def check_metadata(field: str, value: object, *, stored: bool = False) -> None:
    """A flat map of string keys to scalars (str, int of at most :data:`MAX_SAFE_INTEGER`,
    finite float, bool, None): no lists, no nested objects; at most :data:`MAX_METADATA_KEYS`
    keys, each a name that shows as itself (:func:`refuse_invisible`: no NUL, no bidi control,
    no invisible character; ``stored``: see :func:`check_document_id`)."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{field} must be an object, got {type(value).__name__}")
    if len(value) > MAX_METADATA_KEYS:
        raise InvalidArgument(
            f"{field} must have at most {MAX_METADATA_KEYS} keys, got {len(value)}"
        )
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidArgument(
                f"{field} keys must be strings of 1 to {MAX_METADATA_KEY_CHARS} characters, "
                f"got {key[:MAX_METADATA_KEY_CHARS] if isinstance(key, str) else key!r}"
            )
        if not stored:
            refuse_invisible(f"{field} key {key!r}", key)
        where = f"{field}.{key}"
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, int):
            check_integer(where, item)
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidArgument(f"{where} must be a finite number, got {item!r}")
            continue
        if isinstance(item, str):
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise InvalidArgument(
                    f"{where} must be at most {MAX_METADATA_VALUE_CHARS} characters, "
                    f"got {len(item)}"
                )
            refuse_controls(where, item, QUESTION_CONTROLS)
            continue
        raise InvalidArgument(
            f"{where} must be a string, number, boolean or null (metadata is flat), "
            f"got {type(item).__name__}"
        )
