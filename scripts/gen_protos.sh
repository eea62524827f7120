#!/usr/bin/env bash
# Regenerate the committed gRPC stubs from protos/blockspec.proto (tests check they are current).
# protoc names modules by the proto's path under -I: the stubs import each other as
# blockspec.protos.*, the installed package's names, so the proto is read through a staging
# folder where blockspec/protos is this repository's protos/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath "${1:-.}")  # the stubs go to $OUT/protos
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/in/blockspec/protos" "$STAGE/out"
cp protos/blockspec.proto "$STAGE/in/blockspec/protos/"
.venv/bin/python -m grpc_tools.protoc -I "$STAGE/in" --python_out="$STAGE/out" \
  --pyi_out="$STAGE/out" --grpc_python_out="$STAGE/out" "$STAGE/in/blockspec/protos/blockspec.proto"
mkdir -p "$OUT/protos"
cp "$STAGE"/out/blockspec/protos/blockspec_pb2*.py* "$OUT/protos/"
