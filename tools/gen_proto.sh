#!/usr/bin/env bash
# Regenerate the committed Python stubs for serve/proto/*.proto (needs grpcio-tools, the `bench`
# extra). The stubs import each other as jaxinfer.serve.proto, so protoc runs over a scratch
# root in which `jaxinfer` links to this checkout.
#   tools/gen_proto.sh            (uses .venv/bin/python if present, else python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
ln -s "$PWD" "$scratch/jaxinfer"
"$PY" -m grpc_tools.protoc -I"$scratch" --python_out="$scratch" --pyi_out="$scratch" \
  --grpc_python_out="$scratch" \
  jaxinfer/serve/proto/jetstream.proto jaxinfer/serve/proto/jaxinfer.proto
