"""The gateway's HTTP routes, one module per concern, each an ``APIRouter`` of named handlers.

* :mod:`.answer`: ``POST /answer`` (JSON or Server-Sent Events).
* :mod:`.openai`: the OpenAI-compatible API under ``/v1``.
* :mod:`.indexes`: ``GET /indexes``.
* :mod:`.documents`: creating and deleting indexes, and the documents of a live index
  (``/indexes``, ``/indexes/{index}/documents``); writes behind the admin token.
* :mod:`.admin`: ``/admin/*`` (index swap, model reload, replicas), behind the admin token.
* :mod:`.health`: ``/healthz``, ``/readyz``, ``/metrics``.
* :mod:`.pages`: the web page at ``/`` and its static files.

Invariants: a handler only orchestrates (the answer pipeline is ``answering``, the protos
``clients``/``retrieval``/``mapping``); it gets what it works with from
:data:`~openbook_gateway.services.ServicesDep`, never from ``app.state``; every router that
takes a body uses :class:`~openbook_gateway.bodies.JSONBodyRoute`. ``create_app`` includes
them all (tests/services/test_gateway_layout.py checks that no route is a closure).
"""
