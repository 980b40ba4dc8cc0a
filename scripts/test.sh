#!/usr/bin/env bash
# Installs what the tests need, then runs them (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# One worker per core (pytest-xdist), each test file on one worker: a file's launches share its module fixtures.
exec "${PYTHON:-python3}" -m pytest -q -m "" --numprocesses auto --dist loadfile "$@" tests
