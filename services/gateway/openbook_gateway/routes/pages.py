"""The web page for people, served by the gateway at ``/`` (plain HTML/JS from the package).

Everything the page needs lives in the package's ``static/`` folder and ships as package data:
no build step, no CDN, no web fonts. Only the files present there at import time are served
(a fixed allow-list, so no path from a URL ever reaches the file system).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"  # openbook_gateway/static

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

# The page loads nothing from elsewhere and never evaluates strings as code.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(include_in_schema=False)


def _assets() -> dict[str, Path]:
    if not STATIC_DIR.is_dir():
        return {}
    return {
        p.name: p
        for p in STATIC_DIR.iterdir()
        if p.is_file() and p.suffix in MEDIA_TYPES and p.name != "index.html"
    }


ASSETS = _assets()


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(
        STATIC_DIR / "index.html",
        media_type=MEDIA_TYPES[".html"],
        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )


@router.get("/static/{name}")
async def static_file(name: str) -> FileResponse:
    path = ASSETS.get(name)
    if path is None:
        raise HTTPException(404, "not found")
    return FileResponse(
        path,
        media_type=MEDIA_TYPES[path.suffix],
        # Revalidated each load (cheap: ETag/Last-Modified), so an upgrade is seen at once.
        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"},
    )
