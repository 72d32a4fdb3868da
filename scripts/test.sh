#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Needs Postgres on 127.0.0.1:5432
# (user postgres, trust auth) and Redis on 127.0.0.1:6379; tests create and drop their own
# database and start moto's S3 server themselves. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# two workers (tests/conftest.py keeps the service and bench tests on one of them, in order); the
# slowest cases listed: keep the suite short
python -m pytest -q -n "${NIGHTSHIFT_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
