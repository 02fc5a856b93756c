"""Metadata filters on retrieval: the grammar, validated once, and its meaning on one record.

A filter is a JSON object in the style of Pinecone, Chroma and MongoDB queries (the one most
RAG clients already write), restricted to exact matches::

    {"lang": "en"}                                   lang equals "en"
    {"lang": {"$eq": "en"}}                          the same, spelled out
    {"year": {"$in": [2016, 2018]}}                  year is one of the values
    {"lang": "en", "year": 2018}                     every key holds (an implicit $and)
    {"$and": [{"lang": "en"}, {"year": 2018}]}       every filter in the list holds
    {"$or": [{"lang": "en"}, {"source": "wiki"}]}    at least one holds

Grammar (``filter`` is an object; ``scalar`` a string, number, boolean or null)::

    filter := {} | { clause, ... }
    clause := "$and": [filter, ...] | "$or": [filter, ...]
            | key: scalar | key: {"$eq": scalar} | key: {"$in": [scalar, ...]}

Invariants:
  * A :class:`MetadataFilter` that exists has passed :func:`parse_filter`: a non-empty key of at
    most ``MAX_METADATA_KEY_CHARS`` characters not starting with ``$``, scalar values only (a
    list or object where a value belongs is an :class:`InvalidArgument` naming ``filter...``;
    so is an integer past ``MAX_SAFE_INTEGER``, 2**53 - 1, or a non-finite float),
    non-empty ``$and``/``$or``/``$in`` lists, at most ``MAX_FILTER_CONDITIONS`` conditions,
    ``MAX_FILTER_DEPTH`` levels and ``MAX_FILTER_IN_VALUES`` values per ``$in``.
  * Matching is exact and typed: ``true`` never equals ``1`` (Python's ``True == 1`` does not
    leak through), ``2018`` equals ``2018.0`` (JSON has one number type), ``null`` matches a
    key set to null, and a key the record lacks matches nothing: a filter on a key no document
    has keeps no passage, which is an empty result, not an error.
  * Matching never raises on what a record holds: a stored number no filter can hold (an
    integer past ``MAX_SAFE_INTEGER``, written before metadata was bounded, or a non-finite
    float) is :data:`UNMATCHABLE` and matches nothing.
  * :meth:`MetadataFilter.canonical` is the same string for filters that mean the same up to
    the order of keys, list items and ``$in`` values (cache keys, the retriever's
    ``filter_json``); :func:`parse_filter_json` of it has the same canonical form.
  * ``{}`` (and ``None``) is no filter: :func:`parse_filter` returns None.

What a filter sees of a passage is its document's metadata plus two built-in fields, which
take precedence over metadata keys of the same name: ``_id`` (the document id: ``<doc>`` of a
passage ``<doc>#<n>``) and ``_title`` (the document's title). A built index (a corpus build,
an import, a shard) stores no metadata, so only the built-in fields match there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from openbook.errors import InvalidArgument
from openbook.validation.limits import (
    MAX_FILTER_CONDITIONS,
    MAX_FILTER_DEPTH,
    MAX_FILTER_IN_VALUES,
    MAX_FILTER_JSON_CHARS,
    MAX_METADATA_KEY_CHARS,
    MAX_SAFE_INTEGER,
    check_integer,
)

Scalar = str | int | float | bool | None
# A scalar tagged by its JSON type, hashable: what equality compares (bool apart from numbers).
ValueKey = tuple[str, Scalar]

BUILTIN_ID = "_id"
BUILTIN_TITLE = "_title"
BUILTIN_FIELDS = (BUILTIN_ID, BUILTIN_TITLE)
OPERATORS = ("$and", "$or")
VALUE_OPERATORS = ("$eq", "$in")
# The key of a stored number no filter value can equal (value_key): a filter's values are
# checked by _scalar, so none has this kind.
UNMATCHABLE: ValueKey = ("unmatchable", None)


def value_key(value: Scalar) -> ValueKey:
    """``value`` tagged by type: numbers compare by value (2018 == 2018.0), booleans, strings
    and null only with their own kind. Never raises: an integer past ``MAX_SAFE_INTEGER``
    (10**400 would overflow a float) or a non-finite float is :data:`UNMATCHABLE`."""
    if value is None:
        return ("null", None)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("number", value) if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER else UNMATCHABLE
    if isinstance(value, float):
        if not math.isfinite(value):
            return UNMATCHABLE
        # int(2018.0) hashes and compares as 2018.0 does; keep the int for a stable canonical form
        return ("number", int(value) if value.is_integer() else value)
    return ("string", value)


@dataclass(frozen=True)
class Condition:
    """``key`` holds one of ``values`` (``$eq`` is a one-value ``$in``)."""

    key: str
    values: frozenset[ValueKey]

    def matches(self, record: Mapping[str, Any]) -> bool:
        if self.key not in record:
            return False
        value = record[self.key]
        if isinstance(value, list | dict):
            return False  # metadata is flat: nothing to compare a scalar with
        return value_key(value) in self.values

    def to_json(self) -> Any:
        values = sorted(self.values, key=_order)
        if len(values) == 1:
            return {self.key: {"$eq": values[0][1]}}
        return {self.key: {"$in": [v for _, v in values]}}


@dataclass(frozen=True)
class _Junction:
    """Parts joined by ``$and`` (:class:`AllOf`) or ``$or`` (:class:`AnyOf`)."""

    parts: tuple[Node, ...]
    operator: ClassVar[str]
    joined: ClassVar[Callable[[Iterable[bool]], bool]]

    def matches(self, record: Mapping[str, Any]) -> bool:
        return type(self).joined(p.matches(record) for p in self.parts)

    def to_json(self) -> Any:
        return {self.operator: _sorted_json(self.parts)}


@dataclass(frozen=True)
class AllOf(_Junction):
    operator = "$and"
    joined = all


@dataclass(frozen=True)
class AnyOf(_Junction):
    operator = "$or"
    joined = any


Node = Condition | AllOf | AnyOf


@dataclass(frozen=True)
class MetadataFilter:
    """A validated filter (:func:`parse_filter`); ``root`` is its tree of conditions."""

    root: Node

    def matches(self, record: Mapping[str, Any]) -> bool:
        """Whether a passage whose filterable fields are ``record`` (its document's metadata
        with ``_id`` and ``_title``: :func:`record_of`) passes."""
        return self.root.matches(record)

    def to_json(self) -> Any:
        return self.root.to_json()

    def canonical(self) -> str:
        """Compact JSON, keys and lists in a fixed order: equal for equal meanings."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def keys(self) -> frozenset[str]:
        """Every metadata key the filter tests."""
        return frozenset(_keys(self.root))

    def also_matching(self, key: str, alias: Callable[[str], str]) -> MetadataFilter:
        """This filter, where each string value ``v`` a condition on ``key`` holds also lets
        ``alias(v)`` through (a tenant's ``_id`` also names the id its namespace stores)."""
        return MetadataFilter(_with_aliases(self.root, key, alias))


def record_of(doc_id: str, title: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What a filter sees of a document's passages: its metadata and the built-in fields."""
    return {**metadata, BUILTIN_ID: doc_id, BUILTIN_TITLE: title}


def parse_filter(value: Any, field: str = "filter") -> MetadataFilter | None:
    """``value`` (a JSON object, already decoded) as a filter; None for no filter (None or
    ``{}``). Raises :class:`InvalidArgument` naming ``field`` and where in it the problem is."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{field} must be an object, got {_kind(value)}")
    if not value:
        return None
    budget = [MAX_FILTER_CONDITIONS]
    return MetadataFilter(_parse_object(value, field, 1, budget))


def parse_filter_json(text: str, field: str = "filter") -> MetadataFilter | None:
    """A filter from its JSON text (the retriever's ``filter_json``); "" is no filter."""
    if not text:
        return None
    if len(text) > MAX_FILTER_JSON_CHARS:
        raise InvalidArgument(f"{field} must be at most {MAX_FILTER_JSON_CHARS} characters")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"{field} is not valid JSON: {e}") from None
    return parse_filter(value, field)


def _parse_object(obj: Mapping[str, Any], at: str, depth: int, budget: list[int]) -> Node:
    if depth > MAX_FILTER_DEPTH:
        raise InvalidArgument(f"{at}: nested deeper than {MAX_FILTER_DEPTH} levels")
    if not obj:
        raise InvalidArgument(f"{at} must hold at least one condition")
    parts: list[Node] = []
    for key, item in obj.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"{at} keys must be strings, got {key!r}")
        where = f"{at}.{key}"
        if key in OPERATORS:
            if not isinstance(item, list) or not item:
                raise InvalidArgument(f"{where} must be a non-empty list of filters")
            subs: list[Node] = []
            for i, sub in enumerate(item):
                if not isinstance(sub, Mapping):
                    raise InvalidArgument(f"{where}[{i}] must be an object, got {_kind(sub)}")
                subs.append(_parse_object(sub, f"{where}[{i}]", depth + 1, budget))
            parts.append(AllOf(tuple(subs)) if key == "$and" else AnyOf(tuple(subs)))
            continue
        if key.startswith("$"):
            raise InvalidArgument(
                f"{where}: unknown operator {key!r}; expected $and or $or, or a metadata key"
            )
        if not key or len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidArgument(
                f"{at}: keys must be strings of 1 to {MAX_METADATA_KEY_CHARS} characters, "
                f"got {len(key)}"
            )
        budget[0] -= 1
        if budget[0] < 0:
            raise InvalidArgument(f"{at}: at most {MAX_FILTER_CONDITIONS} conditions")
        parts.append(Condition(key, _parse_values(item, where)))
    return parts[0] if len(parts) == 1 else AllOf(tuple(parts))


def _parse_values(item: Any, where: str) -> frozenset[ValueKey]:
    if not isinstance(item, Mapping):
        return frozenset([_scalar(item, where)])
    if len(item) != 1:
        raise InvalidArgument(
            f'{where} must be a scalar, {{"$eq": scalar}} or {{"$in": [scalars]}} '
            f"(one operator), got {len(item)} keys"
        )
    ((op, arg),) = item.items()
    if op == "$eq":
        return frozenset([_scalar(arg, f"{where}.$eq")])
    if op == "$in":
        if not isinstance(arg, list) or not arg:
            raise InvalidArgument(f"{where}.$in must be a non-empty list of scalars")
        if len(arg) > MAX_FILTER_IN_VALUES:
            raise InvalidArgument(
                f"{where}.$in must hold at most {MAX_FILTER_IN_VALUES} values, got {len(arg)}"
            )
        return frozenset(_scalar(v, f"{where}.$in[{i}]") for i, v in enumerate(arg))
    raise InvalidArgument(
        f"{where}: unknown operator {op!r}; expected one of {', '.join(VALUE_OPERATORS)} "
        f"(filters match exactly)"
    )


def _scalar(value: Any, where: str) -> ValueKey:
    if value is None or isinstance(value, str | bool):
        return value_key(value)
    if isinstance(value, int):
        return value_key(check_integer(where, value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"{where} must be a finite number, got {value!r}")
        return value_key(value)
    raise InvalidArgument(
        f"{where} must be a string, number, boolean or null (metadata is flat), got {_kind(value)}"
    )


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _order(v: ValueKey) -> tuple[str, str]:
    return (v[0], json.dumps(v[1]))


def _sorted_json(parts: tuple[Node, ...]) -> list[Any]:
    return sorted((p.to_json() for p in parts), key=lambda j: json.dumps(j, sort_keys=True))


def _with_aliases(node: Node, key: str, alias: Callable[[str], str]) -> Node:
    if isinstance(node, Condition):
        if node.key != key:
            return node
        aliases = {value_key(alias(v)) for _, v in node.values if isinstance(v, str)}
        return Condition(key, node.values | aliases)
    parts = tuple(_with_aliases(p, key, alias) for p in node.parts)
    return AllOf(parts) if isinstance(node, AllOf) else AnyOf(parts)


def _keys(node: Node) -> list[str]:
    if isinstance(node, Condition):
        return [node.key]
    return [k for p in node.parts for k in _keys(p)]


__all__ = [
    "BUILTIN_FIELDS",
    "BUILTIN_ID",
    "BUILTIN_TITLE",
    "AllOf",
    "AnyOf",
    "Condition",
    "MetadataFilter",
    "UNMATCHABLE",
    "Node",
    "parse_filter",
    "parse_filter_json",
    "record_of",
    "value_key",
]
