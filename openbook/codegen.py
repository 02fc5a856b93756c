"""Generate the gRPC stubs in ``openbook/v1`` from ``proto/openbook/v1/*.proto``.

Run by the build (``setup.py``) and, from a source checkout, on first import of
``openbook.v1`` whenever a ``.proto`` file is newer than its stubs, so stubs are never
hand-edited and never stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
PROTO_ROOT = REPO_ROOT / "proto"


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((proto_root / "openbook" / "v1").glob("*.proto"))


def stubs_are_stale(proto_root: Path = PROTO_ROOT, out_root: Path = REPO_ROOT) -> bool:
    for proto in proto_files(proto_root):
        rel = proto.relative_to(proto_root).with_suffix("")
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            stub = out_root / f"{rel}{suffix}"
            if not stub.exists() or stub.stat().st_mtime < proto.stat().st_mtime:
                return True
    return False


def generate(proto_root: Path = PROTO_ROOT, out_root: Path = REPO_ROOT) -> None:
    """Write ``<out_root>/openbook/v1/*_pb2*.py`` for every proto under ``proto_root``."""
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency

    protos = proto_files(proto_root)
    if not protos:
        raise FileNotFoundError(f"no .proto files under {proto_root / 'openbook' / 'v1'}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def ensure_stubs() -> None:
    """Regenerate stubs in a source checkout when the protos changed."""
    if PROTO_ROOT.is_dir() and stubs_are_stale():
        generate()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
