"""The gateway's service layer: what the gateway does, whichever transport asks.

Three transports reach the same operations: the REST routes (``openbook_gateway.routes``), the
OpenAI-compatible ``/v1`` routes (``routes/openai.py`` and the ``openai_*`` formats) and the MCP
tools (``openbook_gateway.mcp_tools``). Each turns its wire format into typed requests and
calls a function here (or :func:`openbook_gateway.answering.answer_events`, the answer
pipeline) with the services and the :class:`~openbook_gateway.operations.caller.Caller`.

* :mod:`.caller`: who asks (the principal the door found) and the request's id.
* :mod:`.indexes`: list, create and delete indexes.
* :mod:`.documents`: write, read, list and delete the documents of a live index.
* :mod:`.search`: passages for a query, and query embeddings.

Invariants:

* No function here takes a transport's request object: the caller, typed requests (the
  request models of ``schemas``, already validated by the transport) and plain values only.
* A function applies the caller's key to what it does (indexes a key is held to, a tenant's
  filter and stamps, ``openbook_gateway.tenancy``) and remembers each acknowledged write's
  version (answer cache, metrics), so every transport does so the same way.
* No module here imports a transport (``tests/deploy/test_import_rules.py``,
  ``test_transports_meet_only_in_the_service_layer``), and no transport imports another.
* Errors are ``HTTPException``s with the status and message a REST client gets (what the
  clients map the services' gRPC codes to); the ``/v1`` and MCP transports translate them into
  their own error shapes.
"""
