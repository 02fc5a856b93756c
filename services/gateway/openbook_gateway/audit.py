"""The audit log (issue 43): one structured line per write, delete, key change and admin action.

Every request to a route whose rule needs more than ``ask`` (``access.RULES``: documents and
uploads, indexes, the admin API, keys) is logged once it is answered, whatever its outcome (a
door's 401 or 403 as well as a 200), by the request middleware (:func:`record`), on the logger
``openbook.audit``: the event ``audit``, with the fields

* ``key``: the name of the key that asked (``admin-token``, ``api-key`` for the static list,
  ``anonymous``), never its secret;
* ``action``: the method and route (``PUT /indexes/{index}/documents/{doc_id:path}``), or an
  MCP tool's name (``mcp:put_document``);
* ``index``, ``ids`` (the documents written or deleted), ``name`` (the index or key made or
  deleted), as the route knew them (:func:`note`);
* ``status`` and ``outcome`` (``ok``, ``refused``, ``failed``).

An MCP write tool's call travels inside a ``POST /mcp`` that answers 200 even when the tool
refuses: the tool logs its own line (:func:`tool`).

The JSON log format (``openbook.observability.logs``) writes the fields as keys of the line's
object.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from starlette.requests import Request

from openbook_gateway.access import RULES, rule_of
from openbook_gateway.principal import ANONYMOUS, ASK, Principal

log = logging.getLogger("openbook.audit")

AUDIT_STATE = "audit"


def key_label(principal: Principal) -> str:
    """The name a request is logged and counted under: its key's, or ``anonymous``."""
    return principal.name if principal.name is not None else "anonymous"


def audited(method: str, route: str) -> bool:
    """Whether a request to ``route`` is audited: a route of the table whose rule needs more
    than ``ask`` (a path no route matched, a scanner's ``/wp-login.php``, is not)."""
    known = ("GET" if method == "HEAD" else method, route) in RULES
    return known and rule_of(method, route).scope not in (None, ASK)


def note(request: Request, **fields: Any) -> None:
    """Add ``fields`` (``ids``, ``index``, ``name``) to the request's audit line."""
    noted = request.scope.setdefault("state", {}).setdefault(AUDIT_STATE, {})
    noted.update(fields)


def outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "failed" if status >= 500 else "refused"


def record(state: MutableMapping[str, Any], action: str, path_params: dict, status: int) -> None:
    """Log a request's audit line (the middleware, once the request is answered): what the
    door found (``state["principal"]``), what the route noted, and its status."""
    principal = state.get("principal")
    who = principal if isinstance(principal, Principal) else ANONYMOUS
    fields: dict[str, Any] = {"event": "audit", "key": key_label(who), "action": action}
    for param in ("index", "name", "doc_id"):
        if isinstance(path_params.get(param), str):
            fields["ids" if param == "doc_id" else param] = (
                [path_params[param]] if param == "doc_id" else path_params[param]
            )
    fields.update(state.get(AUDIT_STATE) or {})
    fields.update(status=status, outcome=outcome(status))
    _emit(fields)


def tool(
    principal: Principal, tool_name: str, outcome_: str, detail: str = "", /, **fields: Any
) -> None:
    """An MCP write tool's audit line (``outcome_``: ``ok``, ``refused`` or ``failed``).
    Positional-only, so that ``fields`` may hold any name (``create_index`` logs ``name``)."""
    line: dict[str, Any] = {
        "event": "audit",
        "key": key_label(principal),
        "action": f"mcp:{tool_name}",
        **fields,
        "outcome": outcome_,
    }
    if detail:
        line["detail"] = detail[:500]
    _emit(line)


def _emit(fields: dict[str, Any]) -> None:
    described = " ".join(
        f"{k}={fields[k]}"
        for k in ("key", "action", "index", "name", "ids", "outcome")
        if k in fields
    )
    log.info("audit %s", described, extra={"fields": fields})
