"""The layer rules of docs/architecture.md, enforced: import-linter's contracts in pyproject.toml
(api > workers > jobs > storage > settings; the engine imports nothing of the service; only the
workers reach the engine and torch; the product never imports bench/)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is a dev dependency (pip install -e '.[dev]')"
    result = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
