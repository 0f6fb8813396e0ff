"""Run config shared by the assets that send work to the fleet: how hard to drive it (never hashed).

The fields, defaults and descriptions are `settings.DispatchSettings`; this only makes them Dagster run config.
"""

import dagster as dg

from dflash_assets.settings import DispatchSettings


# A failed step (servers gone past no_server_timeout_s, a crash) is retried: the ledger makes a retry free, it
# only sends what is not committed. Bad config and preflight refusals raise Failure(allow_retries=False).
FLEET_RETRY = dg.RetryPolicy(max_retries=2, delay=10, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS)


class DispatchRunConfig(dg.Config, DispatchSettings):
    """DispatchSettings, editable in the launchpad."""

    def dispatch(self) -> DispatchSettings:
        return DispatchSettings.taken_from(self)
