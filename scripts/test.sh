#!/usr/bin/env bash
# Installs what the tests need, then runs them (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m pytest -q -m "" "$@" tests
