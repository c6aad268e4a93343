#!/usr/bin/env bash
# Regenerate the committed Python stubs for serve/proto/*.proto (needs grpcio-tools).
#   tools/gen_proto.sh            (uses .venv/bin/python if present, else python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
"$PY" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
  serve/proto/jetstream.proto serve/proto/jaxinfer.proto
