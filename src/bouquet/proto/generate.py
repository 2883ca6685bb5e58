"""Regenerates the committed gRPC code from the .proto files here: `python -m bouquet.proto.generate`.
embedding.proto is the gateway's calls to the replicas; open_inference.proto is KServe's Open Inference Protocol,
which the gateway answers (gateway/api/kserve_grpc.py).

The generated files are committed so a replica needs no protoc at run time; tests/test_proto.py checks that
regenerating gives the same bytes, so the .proto and the code cannot drift apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PROTO_DIR.parent.parent  # src/: each proto is named as bouquet/proto/NAME.proto
PROTOS = ("embedding", "open_inference")
GENERATED = tuple(f"{name}{suffix}" for name in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
# protoc's output follows neither our lint rules nor our formatting; the header keeps ruff off it.
HEADER = "# ruff: noqa\n# fmt: off\n"


def generate(out_root: Path) -> list[Path]:
    """Writes the generated files under out_root/bouquet/proto/ and returns their paths."""
    from grpc_tools import protoc  # build-time only: grpcio-tools is a test dependency

    (out_root / "bouquet" / "proto").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{SOURCE_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}"]
    for name in PROTOS:
        proto = SOURCE_ROOT / "bouquet" / "proto" / f"{name}.proto"
        if protoc.main([*args, f"--grpc_python_out={out_root}", str(proto)]) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    paths = [out_root / "bouquet" / "proto" / name for name in GENERATED]
    for path in paths:
        path.write_text(HEADER + path.read_text())
    return paths


if __name__ == "__main__":
    written = generate(SOURCE_ROOT)
    print("\n".join(str(path) for path in written), file=sys.stderr)
