"""The gRPC stubs are generated from protos/ when the package is built, so that a wheel or an
install from a source tree ships `powerinfer.v1` (the metadata is in pyproject.toml)."""
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO = "powerinfer/v1/inference.proto"


class BuildWithStubs(build_py):
    def run(self):
        root = Path(__file__).resolve().parent
        out = root / "powerinfer" / "v1" / "inference_pb2_grpc.py"
        if not out.exists() or out.stat().st_mtime < (root / "protos" / PROTO).stat().st_mtime:
            subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos",
                            "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", PROTO],
                           cwd=root, check=True)
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
