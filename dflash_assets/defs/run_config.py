"""Run config shared by the assets that send work to the fleet: how hard to drive it (never hashed).

The fields, defaults and descriptions are `settings.DispatchSettings`; this only makes them Dagster run config.
"""

import dagster as dg

from dflash_assets.settings import DispatchSettings


class DispatchRunConfig(dg.Config, DispatchSettings):
    """DispatchSettings, editable in the launchpad."""

    def dispatch(self) -> DispatchSettings:
        return DispatchSettings.taken_from(self)
