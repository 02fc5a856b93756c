"""Who a request is, as the door (:mod:`openbook_gateway.access`) found it: the principal a
route reads from ``request.state`` to narrow what it shows, and :meth:`Principal.index_for`,
the one rule for the index a request may name (issue 43).

Kept apart from the door so that the answer pipeline can ask it without importing the door's
dependencies (no cycle: this module imports nothing of the gateway).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fastapi import HTTPException, Request

from openbook.state.api_keys_protocol import KeyRate
from openbook.validation.metadata_filter import BUILTIN_ID, AllOf, MetadataFilter

ASK, WRITE, INDEXES_CREATE, ADMIN = "ask", "write", "indexes:create", "admin"
# What begins a tenant's namespaced id (``~<tag>~<id>``), and the hex digits of its tag.
NAMESPACE_MARK = "~"
NAMESPACE_TAG_HEX = 16


@dataclass(frozen=True)
class Principal:
    """Who a request is: a key's name (None: anonymous), its scopes and indexes, the owner
    its stored responses belong to (a hash of its token; "" anonymous), its tenant's filter
    and its limits."""

    name: str | None
    scopes: frozenset[str] = frozenset()
    indexes: tuple[str, ...] | None = None  # None: every index
    owner: str = ""
    tenant: MetadataFilter | None = None  # None: every document
    rate: KeyRate | None = None  # None: no limits

    @property
    def known(self) -> bool:
        return self.name is not None

    @property
    def fair_share_class(self) -> str:
        """Who asks, as the generator shares itself out (GenerateRequest.caller): the key's
        name, never its secret; "" for every anonymous caller together."""
        return self.name or ""

    def can(self, scope: str) -> bool:
        return ADMIN in self.scopes or scope in self.scopes

    def sees(self, index: str) -> bool:
        return self.indexes is None or index in self.indexes

    def index_for(self, index: str | None) -> str | None:
        """The index a request naming ``index`` (None: the default) is answered from; a
        404 for an index the key may not name, as for one that does not exist."""
        if self.indexes is None:
            return index
        if index is None:
            return self.indexes[0]
        if index not in self.indexes:
            raise HTTPException(404, self.unknown_index(index))
        return index

    def where(self, requested: MetadataFilter | None) -> MetadataFilter | None:
        """The filter a retrieval asking for ``requested`` runs with: the key's tenant filter
        AND ``requested``. An AND only narrows: nothing a request sends (an ``$or`` naming the
        tenant's field, another tenant's value) reaches a document the tenant filter
        excludes. An ``_id`` the request names is the id as the tenant sees it: it also
        matches that id in the tenant's namespace (:func:`namespace`), where the tenant's own
        documents are stored."""
        if self.tenant is None:
            return requested
        if requested is None:
            return self.tenant
        prefix = namespace(self.tenant)
        requested = requested.also_matching(BUILTIN_ID, lambda doc_id: prefix + doc_id)
        return MetadataFilter(AllOf((self.tenant.root, requested.root)))

    def unknown_index(self, index: str) -> str:
        # the retriever's words for an index it does not have, listing only this key's
        return f"index: unknown index {index!r} (available: {', '.join(self.indexes or ())})"


def namespace(tenant: MetadataFilter) -> str:
    """The prefix of the stored ids of ``tenant``'s documents: ``~<tag>~``, where ``<tag>``
    is the first :data:`NAMESPACE_TAG_HEX` hex digits of the SHA-256 of the filter's canonical
    form (one tenant, one namespace, whichever of its keys writes; :mod:`openbook_gateway.
    tenancy` says what the namespace guarantees)."""
    digest = hashlib.sha256(tenant.canonical().encode()).hexdigest()[:NAMESPACE_TAG_HEX]
    return f"{NAMESPACE_MARK}{digest}{NAMESPACE_MARK}"


ANONYMOUS = Principal(None)
ADMIN_TOKEN_NAME = "admin-token"
API_KEY_NAME = "api-key"


def principal_of(request: Request) -> Principal:
    """Who ``request`` is, as the door found (anonymous if it let it in without asking)."""
    principal = getattr(request.state, "principal", None)
    return principal if isinstance(principal, Principal) else ANONYMOUS
