"""Run config shared by the assets that send work to the fleet: how hard to drive it (never hashed)."""

import dagster as dg
from pydantic import Field

from dflash_assets.generation.config import DispatchSettings


class DispatchConfig(dg.Config):
    max_in_flight_per_server: int = Field(
        0, description="Requests in flight per server; 0 = the server's own max_running_requests + a margin.")
    max_attempts: int = Field(4, description="Attempts per request on retryable errors (5xx, timeouts).")
    commit_rows: int = Field(512, description="Commit a Parquet part every this many rows ...")
    commit_seconds: float = Field(10.0, description="... or every this many seconds.")
    progress_seconds: float = Field(30.0, description="A progress line in the run log every this many seconds.")
    store_token_ids: bool = Field(
        False, description="Record prompt_token_ids and output_ids (return_token_ids): exact ids for training, "
                           "and what continuing truncated rows at a larger cap needs.")
    load_sample_s: float = Field(5.0, description="Poll each server's /v1/loads this often for the fleet tuning "
                                                   "report (0: off).")
    no_server_timeout_s: float = Field(
        120.0, description="Stop the run when no server has been healthy for this long (committed rows stay).")

    def dispatch(self) -> DispatchSettings:
        return DispatchSettings(max_in_flight_per_server=self.max_in_flight_per_server,
                                max_attempts=self.max_attempts, commit_rows=self.commit_rows,
                                commit_seconds=self.commit_seconds, progress_seconds=self.progress_seconds,
                                no_server_timeout_s=self.no_server_timeout_s, store_token_ids=self.store_token_ids,
                                load_sample_s=self.load_sample_s)
