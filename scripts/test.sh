#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Needs Postgres on 127.0.0.1:5432
# (user postgres, trust auth) and Redis on 127.0.0.1:6379; tests create and drop their own
# database and start moto's S3 server themselves. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# Two pytest-xdist workers: each test's torch runs on one thread (tests/conftest.py), and the service
# tests mostly wait on their subprocesses, so one worker alone kept ~1 of 2 cores busy. A file runs
# whole on one worker (its module fixtures made once); each file that uses Redis has a database of
# its own (tests/service/conftest.py checks it). `-n 0` runs everything in this one process.
python -m pytest -q -n 2 --dist loadfile --durations=25 "$@"   # the slowest cases listed: keep the suite short
