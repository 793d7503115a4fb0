#!/usr/bin/env bash
# Regenerates proto/prefill_pb2*.py from proto/prefill.proto (the .proto is the source of truth).
# A pinned, older grpcio-tools keeps the stubs importable by older grpcio/protobuf runtimes (grpcio >= 1.62).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
python3 -m venv "$venv"
"$venv/bin/pip" install -q "grpcio-tools==1.62.3"
"$venv/bin/python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/prefill.proto
rm -rf "$venv"
echo "regenerated proto/prefill_pb2.py, proto/prefill_pb2.pyi, proto/prefill_pb2_grpc.py"
