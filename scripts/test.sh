#!/usr/bin/env bash
# Installs what the tests need, then runs them (CPU, gloo). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# One pytest-xdist worker per core, each test file on one worker (a file's launches share its module fixtures), the
# files in collection order (tests/megatron/ first), so that the short files fill the end instead of a long one.
# Launches never pick a port for another process to bind (tools/local_ranks.py), so workers can start them at once.
exec "${PYTHON:-python3}" -m pytest -q -m "" --numprocesses auto --dist loadfile --no-loadscope-reorder "$@" tests
