"""Build hook: generate the gRPC stubs from proto/ before packaging (see openbook/codegen.py)."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithProtos(build_py):
    def run(self) -> None:
        spec = importlib.util.spec_from_file_location("codegen", ROOT / "openbook" / "codegen.py")
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)
        codegen.generate(ROOT / "proto", ROOT)
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
