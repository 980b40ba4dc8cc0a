#!/usr/bin/env bash
# Installs what megatron-zero-bubble needs on a fresh machine (CPU or GPU), then the project itself.
# torch is pinned first so that nothing later asks pip for a newer build (which would pull CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MCORE_VERSION=${MCORE_VERSION:-0.19.2}
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install "torch==${TORCH_VERSION}"
fi
TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
pip_install "$TORCH_PIN" numpy "packaging>=24.2" six regex pyyaml pydantic psutil highspy matplotlib pytest
if ! "$PY" -c "import importlib.metadata as m; assert m.version('megatron-core') == '${MCORE_VERSION}'" 2>/dev/null; then
  # megatron-core asks for Python >= 3.12; on 3.11 it builds from its sdist (see shared/reference/megatron-cpu.md).
  if "$PY" -c "import sys; sys.exit(sys.version_info >= (3, 12))"; then
    pip_install --ignore-requires-python --no-deps "megatron-core==${MCORE_VERSION}"
  else
    pip_install "megatron-core==${MCORE_VERSION}" "$TORCH_PIN"
  fi
fi
pip_install --no-deps -e .
