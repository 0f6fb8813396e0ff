#!/usr/bin/env bash
# Run the test suite on a fresh machine: uv (with pip, if missing), the locked environment, SGLang's wheel
# without its dependencies (the contract tests read its schema file; importing it would pull a CUDA torch),
# Debian's Chromium for the browser tests and postgresql + redis-server for the multi-machine tests (when
# missing and we are root), then pytest with this script's arguments, e.g.
# `bash scripts/test.sh tests/engines/test_ui_browser.py -x` (in 3 worker processes, pytest-xdist).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.local/bin:$PATH"

command -v uv >/dev/null 2>&1 || python3 -m pip install uv
# bytecode compiled once here: where PYTHONDONTWRITEBYTECODE is set (as on CI) every Python process would otherwise
# compile Dagster and the rest again, ~5 s of each CLI run, emulator, step process and code server the tests start
uv sync --locked --compile-bytecode
uv run --locked python -m compileall -q -j 0 dflash_assets tests benchmarks scripts >/dev/null
uv pip install --no-deps sglang==0.5.23

# the field's habits before the tests: ruff (lint, imports, format: [tool.ruff] in pyproject.toml), then mypy
# on dflash_assets/ ([tool.mypy]: the pydantic plugin, check_untyped_defs)
uv run --locked ruff check --quiet .
uv run --locked ruff format --check --quiet .
uv run --locked mypy
# the house in figures (lines, long functions, dict reads of our rows, untested modules): every run records them
uv run --locked python scripts/house.py

if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "+ installing Debian's chromium for the browser tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium >/dev/null
  else
    echo "scripts/test.sh: /usr/bin/chromium is missing and this is not root; install Debian's chromium" \
         "(apt-get install chromium) or the browser tests fail under CI=true and are skipped elsewhere" >&2
  fi
fi

# Debian's postgresql and redis-server for the multi-machine tests (a throwaway Postgres instance, the Celery
# broker); each test session starts its own on loopback ports and stops it.
missing=()
compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null || command -v pg_ctl >/dev/null 2>&1 || missing+=(postgresql)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "+ installing Debian's ${missing[*]} for the Postgres, Celery and Redis tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "scripts/test.sh: ${missing[*]} missing and this is not root; install them (apt-get install" \
         "${missing[*]}) or tests/engines/test_postgres_instance.py and tests/engines/test_celery.py fail" >&2
  fi
fi

# the tests' temp dirs (Dagster instances, their SQLite event logs, Parquet parts, emulator logs) in memory when
# /dev/shm has room: SQLite commits once per Dagster event, 9 ms of CPU each on disk here and 4 ms on tmpfs (the
# fast suite: 7:19 -> 5:34, 718 -> 520 s of CPU). An explicit TMPDIR is kept.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ] \
   && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt $((2 * 1024 * 1024)) ]; then
  TMPDIR="$(mktemp -d /dev/shm/dflash-tests.XXXXXX)"
  chmod 711 "$TMPDIR"  # as root, Postgres runs as the postgres user: its data directory in here must be reachable
  export TMPDIR
  trap 'rm -rf "$TMPDIR"' EXIT
fi

# three workers on 2 cores: most of a test is waiting on the servers and processes it started (a run of the whole
# suite keeps 2.8 tests busy at once); a file stays on one worker, so its module fixtures (a fleet, a demo run) are
# built once. Files go out in collection order, the long ones first (tests/conftest.py). DFLASH_TEST_WORKERS=0 runs
# in this process (for a debugger).
uv run --locked pytest -n "${DFLASH_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
