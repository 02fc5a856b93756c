"""PDFs written byte by byte, for what a PDF library would not write: every page drawing one
shared content stream (what made pypdf parse that stream once per page)."""

from __future__ import annotations

import zlib


def shared_stream_pdf(n_pages: int, content: bytes) -> bytes:
    """A PDF of ``n_pages`` pages whose ``/Contents`` are all one stream (object 4, deflated),
    drawn with Helvetica as ``/F1``."""
    stream = zlib.compress(content)
    kids = " ".join(f"{5 + i} 0 R" for i in range(n_pages))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {n_pages} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        _stream(stream),
    ] + [
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 3 0 R >> >> >>"
    ] * n_pages
    return _written(objects)


def distinct_streams_pdf(contents: list[bytes]) -> bytes:
    """A PDF of one page per item of ``contents``, each drawing its own stream (deflated)."""
    n = len(contents)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, content in enumerate(contents):
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
            b"/Resources << /Font << /F1 3 0 R >> >> >>" % (5 + 2 * i)
        )
        objects.append(_stream(zlib.compress(content)))
    return _written(objects)


def _stream(deflated: bytes) -> bytes:
    return (
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(deflated)
        + deflated
        + b"\nendstream"
    )


def _written(objects: list[bytes]) -> bytes:
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def text_operations(words: str, repeat: int) -> bytes:
    """A content stream that writes ``words`` once, then runs ``repeat`` more text operators
    that draw nothing new (each one interpreted by a text extractor)."""
    return b"BT /F1 12 Tf 72 720 Td (" + words.encode() + b") Tj ET\n" + b"BT ET\n" * repeat
