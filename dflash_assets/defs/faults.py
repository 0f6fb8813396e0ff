"""How a step stops on a fault: named in one line, and retried only where a retry can cure it.

Dagster's RetryPolicy retries every exception alike and ends with "Exceeded max_retries of N". So a step that
writes the data dir runs inside `named_stops`: a resource that ran out (store/exhaustion.py) stops at once
(`Failure(allow_retries=False)`), and a retried step's final attempt raises its own exception as the Failure.
Either way the failure's metadata holds the recount of the committed rows (defs/metadata.py StepStopKeys): a failed
step records no materialisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import NoReturn

import dagster as dg
from dagster._core.instance.ref import InstanceRef

from dflash_assets.defs.metadata import StepStopKeys
from dflash_assets.defs.resources import DataDirResource
from dflash_assets.fleet.client import ServerError
from dflash_assets.generation.preflight import PreflightError
from dflash_assets.generation.slots import FleetDown
from dflash_assets.generation.stopping import STOP, Stopped, stopping
from dflash_assets.store.exhaustion import exhaustion


def rerun_cures(e: BaseException) -> bool:
    """A fault a later run can cure: the fleet went away or was slow, not a setting or a bug."""
    import aiohttp

    return isinstance(e, FleetDown | ServerError | TimeoutError | ConnectionError | aiohttp.ClientConnectionError)


def preflight_failure(e: PreflightError) -> dg.Failure:
    """The preflight's refusal (nothing was sent), with its words and the context length that fits as metadata."""
    metadata: dict[str, str | int] = {StepStopKeys.CAUSE: "preflight", StepStopKeys.REFUSAL: str(e)}
    if e.context_length_needed:
        metadata[StepStopKeys.CONTEXT_LENGTH_NEEDED] = e.context_length_needed
    return dg.Failure(f"preflight: {e}", metadata=metadata, allow_retries=False)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def cause_line(e: BaseException) -> str:
    """An exception as a person reads it: its type and first line, and its first cause's."""
    cause = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return first_line(e) + (f" (caused by {first_line(cause)})" if cause is not None else "")


@contextmanager
def named_stops(
    context: dg.AssetExecutionContext,
    data_dir: DataDirResource,
    committed: Callable[[], dict[str, int]] | None = None,
    retry: dg.RetryPolicy | None = None,
) -> Iterator[None]:
    """Run the step's body; turn an exhaustion, and the last attempt's failure under `retry`, into a named Failure
    with `committed()` (rows per shard) recounted. SIGINT and SIGTERM end the run CANCELED."""
    try:
        with stopping():
            STOP.check()  # a signal before the step (its resources' start, the step before): it does not run
            yield
            STOP.check()  # a signal during a step that does not listen for it: the run stops after the step
    except Stopped as e:
        cancel(context, e)
    except dg.Failure:
        raise  # already said (a config refusal, the preflight)
    except Exception as e:
        root = data_dir.resolved()
        found = exhaustion(e, root if isinstance(root, Path) else data_dir.local_dir())
        final = retry is not None and context.retry_number >= retry.max_retries
        if found is None and not final:
            raise  # Dagster retries it
        counts = _recount(committed)
        rows = sum(counts.values()) if counts is not None else None
        if found is not None:
            message, cause = found.line(rows), "exhausted"
        else:
            message, cause = f"{cause_line(e)}, after {context.retry_number + 1} attempts", "retried"
        metadata: dict[str, str | int | None | dg.MetadataValue] = {
            StepStopKeys.CAUSE: cause,
            StepStopKeys.RERUN_CURES: found is None and rerun_cures(e),
        }
        if counts is not None:
            metadata |= {
                StepStopKeys.COMMITTED_ROWS: rows,
                StepStopKeys.COMMITTED_BY_SHARD: dg.MetadataValue.json(counts),
            }
        raise dg.Failure(message, metadata=metadata, allow_retries=False) from e


def cancel(context: dg.AssetExecutionContext, stopped: Stopped) -> NoReturn:
    """End the run CANCELED (Dagster 1.13's execution/api.py records a CANCELING run's failure so), freeing the
    step's pool slots, with a Failure not retried (execution/plan/utils.py turns an interrupt into a retry)."""
    run = context.instance.get_run_by_id(context.run.run_id) or context.run
    if run.status != dg.DagsterRunStatus.CANCELING:
        context.instance.report_run_canceling(run, message=f"{stopped}: the answers received were committed")
    raise dg.Failure(str(stopped), allow_retries=False) from None


NO_COMPUTE_LOGS = {"module": "dagster._core.storage.noop_compute_log_manager", "class": "NoOpComputeLogManager"}


@cache
def in_process_instance(home: str) -> dg.DagsterInstance:
    """DAGSTER_HOME's instance without compute log capture (its helpers print tracebacks at a Ctrl-C)."""
    ref = InstanceRef.from_dir(home, overrides={"compute_logs": NO_COMPUTE_LOGS})
    return dg.DagsterInstance.from_ref(ref)


def _recount(committed: Callable[[], dict[str, int]] | None) -> dict[str, int] | None:
    if committed is None:
        return None
    try:
        return committed()
    except Exception:  # noqa: BLE001 - the stop is said either way; the count is a courtesy (EMFILE can block it)
        return None
