#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Needs Postgres on 127.0.0.1:5432
# (user postgres, trust auth) and Redis on 127.0.0.1:6379; tests create and drop their own
# database and start moto's S3 server themselves. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q --durations=25 "$@"   # the slowest cases listed: keep the suite short
