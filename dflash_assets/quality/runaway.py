"""The runaway rule (generation/runaway.py) in DuckDB: quality counts the cut rows that loop by the rule that
generation stops streams by."""

import duckdb
import pyarrow as pa

from dflash_assets.generation.runaway import is_runaway
from dflash_assets.settings import RunawaySettings


def register_runaway(con: duckdb.DuckDBPyConnection, runaway: RunawaySettings = RunawaySettings()) -> None:
    """`is_runaway(tail VARCHAR) -> BOOLEAN` on `con`, judged by `runaway`. Vectorised (a batch of rows per call
    through Arrow): a call per row would cost more than the test itself."""

    def batch(tails: pa.Array) -> pa.Array:
        return pa.array([is_runaway(t, runaway) for t in tails.to_pylist()], pa.bool_())

    # duckdb's stubs type a UDF by the Python values it returns; an Arrow UDF returns a pa.Array
    con.create_function("is_runaway", batch, ["VARCHAR"], "BOOLEAN", type="arrow", null_handling="special")  # type: ignore[call-overload]
