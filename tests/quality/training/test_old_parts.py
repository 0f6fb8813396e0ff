"""A data dir written before a column existed: its parts lack the column, and every reader takes it as null."""

import shutil

import pyarrow.parquet as pq

from dflash_assets.quality import export_training_set, length_quality, run_checks
from tests.support.quality_data import build_clean

# the window policy's columns (issue 20) and the runaway stop's (issue 22): parts from before them have none
NEWER = ("policy_cap", "trainer_max_length", "loop_start_tokens")


def without_newer_columns(data_dir):
    for part in (data_dir / "completions").rglob("*.parquet"):
        table = pq.read_table(part)
        pq.write_table(table.drop_columns([c for c in NEWER if c in table.column_names]), part)


def test_a_data_dir_from_before_the_window_columns_is_checked_reported_and_exported_as_a_new_one(tmp_path):
    new, old = build_clean(tmp_path / "new"), tmp_path / "old"
    shutil.copytree(new, old)
    without_newer_columns(old)
    assert not set(NEWER) & set(pq.read_schema(next((old / "completions").rglob("*.parquet"))).names)

    def figures(data_dir):
        return (
            [(o.name, o.passed, o.metadata) for o in run_checks(data_dir)],
            {k: v for k, v in length_quality(data_dir).items() if k != "data_dir"},
        )

    assert figures(old) == figures(new)
    exported = export_training_set(old, tmp_path / "out-old")
    assert exported.manifest["rows"] == export_training_set(new, tmp_path / "out-new").manifest["rows"] > 0
