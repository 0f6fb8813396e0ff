"""The one `defs`: every asset, check, job, schedule and sensor under dflash_assets/defs/, and the resources.

Nothing is listed by hand: `load_from_defs_folder` (Dagster 1.13, public) imports every module of the defs package
(found from [tool.dg.project] in pyproject.toml) and takes the definitions at module scope, so a new asset, check,
job, schedule or sensor in a domain folder (defs/<domain>/assets.py, checks.py, jobs.py, schedules.py, sensors.py)
is loaded by being written. `load_definitions_from_package_module` does the same but is @preview in 1.13.27 and
warns at every load ("may have breaking changes in patch version releases"); so does `load_definitions_from_modules`
underneath it. Resources and the executor are applied here, once, for every job.
"""

from pathlib import Path

import dagster as dg

from dflash_assets.defs.resources import from_env

defs = dg.Definitions.merge(
    dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
    dg.Definitions(
        resources=from_env(),
        # A run's steps follow one another (shards -> completions -> checks -> report) and are thin HTTP and
        # DuckDB work: one process per run, instead of a ~10 s process start per step on a small host.
        executor=dg.in_process_executor,
    ),
)
