#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from protos/blockspec.proto (tests check they are current).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.}
.venv/bin/python -m grpc_tools.protoc -I . --python_out="$OUT" --pyi_out="$OUT" \
  --grpc_python_out="$OUT" protos/blockspec.proto
