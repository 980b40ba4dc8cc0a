#!/usr/bin/env bash
# Installs megatron-zero-bubble and what it needs (CPU or GPU) into $PYTHON (default: python3).
# Use a virtualenv unless this machine is yours alone:  python3 -m venv .venv && PYTHON=.venv/bin/python bash scripts/install.sh
# torch is installed (pinned) first and kept, so that nothing later asks pip for a newer build (which
# would pull CUDA wheels); numpy comes before torch is first imported.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MCORE_VERSION=${MCORE_VERSION:-0.19.2}
TE_VERSION=${TE_VERSION:-2.20.2}
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

if [ -z "${VIRTUAL_ENV:-}" ] && [ "$("$PY" -c 'import sys; print(sys.prefix == sys.base_prefix)')" = True ]; then
  echo "install.sh: installing into $("$PY" -c 'import sys; print(sys.prefix)') (not a virtualenv)" >&2
fi
pip_install numpy "packaging>=24.2"
if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install "torch==${TORCH_VERSION}"
fi
TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
if ! "$PY" -c "import importlib.metadata as m; assert m.version('megatron-core') == '${MCORE_VERSION}'" 2>/dev/null; then
  # megatron-core 0.19.2 declares Python >= 3.12 and has wheels for 3.12 only; its sdist works on 3.11 (it compiles
  # megatron's dataset helpers with the system's C++ compiler, seconds), so there it is installed from the sdist past
  # that declaration, without its dependencies (numpy and packaging are above, torch is kept).
  if "$PY" -c "import sys; sys.exit(sys.version_info >= (3, 12))"; then
    pip_install --ignore-requires-python --no-deps "megatron-core==${MCORE_VERSION}"
  else
    pip_install "megatron-core==${MCORE_VERSION}" "$TORCH_PIN"
  fi
fi
# On a machine without CUDA: Transformer Engine's Python (megatron's default layers), which runs there over this package's
# CPU kernel layer (docs/transformer-engine.md). Only its Python wheel, without dependencies (the CUDA core library and
# the compiled extension are other packages), and what its Python imports. A TE with its extension (a GPU install) is
# never touched.
# The suite also runs the split on one release of each other line of that page's version table (TE_RELEASES, each in
# .te-releases/RELEASE, put on PYTHONPATH by the test that uses it).
TE_RELEASES=${TE_RELEASES:-2.5.0 2.12.0 2.19.0}
if "$PY" -c "import sys, torch; sys.exit(torch.cuda.is_available())" \
   && ! "$PY" -c "import importlib.metadata as m; m.version('transformer-engine-torch')" 2>/dev/null; then
  if ! "$PY" -c "import importlib.metadata as m; assert m.version('transformer-engine') == '${TE_VERSION}'" 2>/dev/null; then
    pip_install --no-deps "transformer-engine==${TE_VERSION}"
    pip_install onnxscript einops "$TORCH_PIN"
  fi
  for release in $TE_RELEASES; do
    [ -d ".te-releases/$release/transformer_engine" ] ||
      pip_install --no-deps --target ".te-releases/$release" "transformer-engine==$release"
  done
fi
# The package with its declared dependencies (pyproject.toml) and pytest; the pin keeps the torch we have.
pip_install -e ".[test]" "$TORCH_PIN"
