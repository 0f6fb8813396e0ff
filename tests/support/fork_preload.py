"""What the fork server of tests/support/forks.py imports once, so that every `dflash` command and emulator forked
from it starts warm (a child spends nothing on imports it would repeat):
- the libraries the commands use;
- the storage modules Dagster imports when it first opens an instance (SQLAlchemy, alembic, the SQLite storages:
  about 1.7 s of CPU), by opening one in a throwaway DAGSTER_HOME with the project's dagster.yaml;
- the layers below the definitions: settings, fleet/, generation/, quality/ (they read no setting at import), and the
  emulator's server.

Never `dflash_assets.defs` or `dflash_assets.definitions`: they read the deployment's settings from the environment
at import (the shards per run, the resources), and the environment is the command's. The assertion below keeps it so.
"""

import gc
import importlib
import pkgutil
import shutil
import sys
import tempfile
from pathlib import Path

import aiohttp  # noqa: F401
import dagster as dg
import duckdb  # noqa: F401
import matplotlib.backends.backend_agg  # noqa: F401
import matplotlib.figure  # noqa: F401
import numpy  # noqa: F401
import pyarrow.parquet  # noqa: F401
import pydantic  # noqa: F401
import rich.console  # noqa: F401
import rich.progress  # noqa: F401
import rich.table  # noqa: F401

import dflash_assets.emulator.server  # noqa: F401
import dflash_assets.fleet
import dflash_assets.generation
import dflash_assets.quality
import dflash_assets.rules  # noqa: F401
import dflash_assets.settings  # noqa: F401

PROJECT_DAGSTER_YAML = Path(__file__).resolve().parents[2] / "dagster_home" / "dagster.yaml"

with tempfile.TemporaryDirectory(prefix="dflash-preload-") as _home:
    shutil.copy(PROJECT_DAGSTER_YAML, _home)
    with dg.DagsterInstance.from_config(_home) as _instance:
        _instance.get_runs(limit=1)

dflash_assets.emulator.model.build_streams(non_ascii=True)

for _package in (dflash_assets.fleet, dflash_assets.generation, dflash_assets.quality):
    for _module in pkgutil.iter_modules(_package.__path__, _package.__name__ + "."):
        importlib.import_module(_module.name)

_settings_readers = sorted(m for m in sys.modules if m.startswith(("dflash_assets.defs", "dflash_assets.definitions")))
assert not _settings_readers, f"the fork server must not import what reads the settings at import: {_settings_readers}"

# what is loaded is never garbage: kept out of the collector's passes in every child
gc.freeze()
