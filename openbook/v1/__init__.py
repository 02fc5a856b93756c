"""Generated gRPC stubs for ``proto/openbook/v1`` (built by ``openbook/codegen.py``)."""

from openbook.codegen import ensure_stubs

ensure_stubs()
