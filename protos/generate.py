"""Generate the Python stubs for protos/tandem/v1/*.proto (run after editing a .proto; a test fails when stale).

The stubs are committed so a fresh clone works without grpcio-tools; `python -m protos.generate --check` compares
what would be generated with what is committed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ["protos/tandem/v1/tandem.proto"]
OUTPUTS = ["tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py"]


def _include_dirs() -> list[str]:
    import google.api  # googleapis-common-protos ships google/api/*.proto beside the modules
    import grpc_tools

    googleapis = Path(google.api.__path__[0]).parent.parent
    return [str(ROOT), str(googleapis), str(Path(grpc_tools.__file__).parent / "_proto")]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = ["grpc_tools.protoc", *[f"-I{d}" for d in _include_dirs()], f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTO_FILES]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
    finally:
        os.chdir(cwd)


def stale_files() -> list[str]:
    """Generated files whose committed content differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for name in OUTPUTS:
            fresh = Path(tmp) / "protos/tandem/v1" / name
            committed = ROOT / "protos/tandem/v1" / name
            if not committed.exists() or committed.read_text() != fresh.read_text():
                stale.append(str(committed.relative_to(ROOT)))
        return stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed stubs are stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated stubs:", *stale, "- run `python -m protos.generate`", file=sys.stderr)
            sys.exit(1)
        print("stubs up to date")
        return
    generate(ROOT)
    print("generated", *OUTPUTS)


if __name__ == "__main__":
    main()
