"""`launch` mode: one `sglang serve` per GPU, detached, recorded in the registry, reused while healthy and launched
with the same args (loading takes minutes); a dead one relaunched, one with other args replaced only when asked.

SGLang 0.5.23 takes its key only as `--api-key`: on the child's command line, as when typed by hand; never in the
registry, a hash, status, a log tail or the child's environment. SGLang prints its args, so logs are 0600 in 0700.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as with_fields
from datetime import UTC, datetime
from pathlib import Path
from threading import Event

from dflash_assets.fleet import processes, registry
from dflash_assets.fleet.client import ServerAccessError, ServerClient, ServerError
from dflash_assets.fleet.fleet import WAIT_SAY_EVERY_S, open_session
from dflash_assets.fleet.registry import ServerRecord
from dflash_assets.fleet.server_args import COMMANDS, SGLANG_SERVE, ServerCommand, args_hash, diff
from dflash_assets.settings import Deployment, LaunchSettings, ServerSettings

Events = Callable[[str], None] | None
DONE = {
    "launch": "launched",
    "relaunch": "relaunched (it was not running)",
    "replace": "replaced (args changed)",
    "reuse": "reused (running with the same args)",
}


class FleetError(RuntimeError):
    pass


@dataclass(frozen=True)
class FleetSpec:
    """The fleet asked for: the args every server shares, the GPUs, and how servers are started."""

    server: ServerCommand  # port and gpus are set per server
    gpus: tuple[int, ...] = (0,)
    base_port: int = LaunchSettings().base_port  # GPU g's server listens on base_port + g: fixed when GPUs change
    command: tuple[str, ...] = SGLANG_SERVE
    api_key_env: str = Deployment.API_KEY.name
    health_timeout_s: float = LaunchSettings().health_timeout_s  # loading weights and cuda graphs takes minutes
    stop_timeout_s: float = 30.0

    def servers(self) -> dict[str, ServerCommand]:
        tp = self.server.tp_size
        if not self.gpus:
            raise FleetError("the fleet has no GPUs: give at least one GPU id")
        if len(set(self.gpus)) != len(self.gpus):
            raise FleetError(f"GPU ids repeat: {list(self.gpus)}")
        if len(self.gpus) % tp:
            raise FleetError(f"{len(self.gpus)} GPUs cannot be split into servers of tp_size {tp}")
        groups = [tuple(self.gpus[i : i + tp]) for i in range(0, len(self.gpus), tp)]
        return {
            "gpu" + "-".join(map(str, g)): with_fields(self.server, gpus=g, port=self.base_port + g[0]) for g in groups
        }


def default_fleet_dir(dagster_home: str | Path | None = None) -> Path:
    """`<dagster_home>/fleet`, where the registry and the server logs live."""
    home = dagster_home or os.environ.get("DAGSTER_HOME") or "dagster_home"
    return Path(home).resolve() / "fleet"


def parse_gpus(gpus: str) -> tuple[int, ...]:
    try:
        return tuple(int(g) for g in gpus.split(",") if g.strip())
    except ValueError:
        raise ValueError(f"gpus must be comma-separated GPU ids such as '0,1,2,3', got {gpus!r}") from None


def build_spec(settings: LaunchSettings, api_key_env: str = Deployment.API_KEY.name) -> FleetSpec:
    """The one way from launch settings (CLI flags or the fleet resource's launch config) to a FleetSpec."""
    if not settings.model_path:
        raise ValueError("launch mode needs a model path (the model every server loads)")
    # every flag passed as set, None included: None is "SGLang decides", not "take the default"
    flags = {name: getattr(settings, name) for name in ServerSettings.model_fields}
    server = ServerCommand(model_path=settings.model_path, extra_args=tuple(shlex.split(settings.extra_args)), **flags)
    return FleetSpec(
        server=server,
        gpus=parse_gpus(settings.gpus),
        base_port=settings.base_port,
        command=COMMANDS.get(settings.command) or tuple(shlex.split(settings.command)),  # a name, or a command line
        api_key_env=api_key_env,
        health_timeout_s=settings.health_timeout_s,
    )


def up(
    spec: FleetSpec, fleet_dir: Path, replace: bool = False, on_event: Events = None, stop: Event | None = None
) -> list[ServerRecord]:
    """Bring the fleet to `spec`; its servers once each answers GET /health 200 (FleetError if `stop` is set first)."""
    say = on_event or (lambda _msg: None)
    key = os.environ.get(spec.api_key_env) or None
    wanted = spec.servers()
    with registry.locked(fleet_dir):
        records = registry.load(fleet_dir)
        plan: dict = {}
        refusals: list = []
        for name, args in wanted.items():
            plan[name] = _decide(name, args, records.get(name), spec, key, replace, refusals)
        if refusals:  # all or nothing: refuse before touching any server
            raise FleetError("\n".join(refusals))
        for name in sorted(set(records) - set(wanted)):
            say(f"{name}: in the registry but not asked for; left as it is (`down` stops it)")
        for name, action in plan.items():
            if action in ("relaunch", "replace"):  # also ends orphaned children still holding the GPU
                old = records.pop(name)
                processes.stop_group(old.pid, old.proc_start, spec.stop_timeout_s)
                registry.save(fleet_dir, records)
        for name, action in plan.items():  # every port before any launch: all or nothing again
            if action != "reuse":
                _check_port(wanted[name], records)
        for name, action in plan.items():
            if action != "reuse":
                records[name] = _launch(name, wanted[name], spec, Path(fleet_dir), key)
                registry.save(fleet_dir, records)  # recorded at once: a crash now still leaves it findable
            rec = records[name]
            say(f"{name}: {DONE[action]}: pid {rec.pid}, {rec.url}, GPU {','.join(map(str, rec.gpus)) or '-'}")
    # Waited for outside the lock, so `down` can still stop a server that never gets healthy.
    ours = [records[n] for n in wanted]
    asyncio.run(_wait_healthy(ours, key, spec.health_timeout_s, say, stop or Event()))
    return ours


def ended(spec: FleetSpec, fleet_dir: Path) -> list[str]:
    """The servers of `spec` in the registry whose process ended: those `up` relaunches."""
    records = registry.load(fleet_dir)
    return [n for n in spec.servers() if n in records and not processes.is_ours(records[n].pid, records[n].proc_start)]


def _decide(
    name: str,
    args: ServerCommand,
    rec: ServerRecord | None,
    spec: FleetSpec,
    key: str | None,
    replace: bool,
    refusals: list[str],
) -> str:
    if rec is None:
        return "launch"
    if not processes.is_ours(rec.pid, rec.proc_start):
        return "relaunch"
    changes = diff(rec.args, args.canonical())
    if not changes and rec.args_hash != args_hash(args, spec.command):
        old_command = rec.command[: len(rec.command) - len(ServerCommand.from_dict(rec.args).flags())]
        changes = [f"launch command: {' '.join(old_command)} -> {' '.join(spec.command)}"]
    if bool(rec.api_key_env) != bool(key):
        changes.append(f"API key: {'set' if rec.api_key_env else 'none'} -> {'set' if key else 'none'}")
    elif key and asyncio.run(_rejects_key(rec.url, key)):
        changes.append(f"API key: the server rejects the key in ${spec.api_key_env} (launched with another)")
    if not changes:
        return "reuse"
    if replace:
        return "replace"
    refusals.append(
        f"server {name} (pid {rec.pid}, {rec.url}) is running with other args than asked:\n    "
        + "\n    ".join(changes)
        + "\n  It was not restarted. To restart it with the new args: `dflash fleet up --replace` "
        "(up(..., replace=True)); or `dflash fleet down` first."
    )
    return "refuse"


def _check_port(args: ServerCommand, records: dict[str, ServerRecord]) -> None:
    if not processes.port_in_use(args.host, args.port):
        return
    holder = next((r for r in records.values() if r.port == args.port and processes.is_ours(r.pid, r.proc_start)), None)
    who = f"fleet server {holder.name} (pid {holder.pid})" if holder else "a process that is not in the fleet registry"
    raise FleetError(
        f"port {args.port} on {args.host} is already in use by {who}; stop it or choose another "
        f"base port (servers listen on base_port + GPU id)"
    )


def _launch(name: str, args: ServerCommand, spec: FleetSpec, fleet_dir: Path, key: str | None) -> ServerRecord:
    log = fleet_dir / "logs" / f"{name}.log"
    if log.exists():  # keep the previous run's log: after a crash it is the one worth reading
        log.replace(log.with_suffix(".log.1"))
    argv = args.argv(spec.command)
    env = {k: v for k, v in os.environ.items() if k != spec.api_key_env}
    if args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, args.gpus))
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "w") as f:
        f.write(
            f"# dflash fleet: {name} launched {started_at}, CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', '(inherited)')}: {' '.join(argv)}"
            f"{' --api-key (from $' + spec.api_key_env + ')' if key else ''}\n"
        )
    proc = processes.spawn(argv + (["--api-key", key] if key else []), env, log)
    return ServerRecord(
        name=name,
        pid=proc.pid,
        proc_start=processes.start_time(proc.pid),
        host=args.host,
        port=args.port,
        gpus=list(args.gpus),
        args_hash=args_hash(args, spec.command),
        args=args.canonical(),
        command=argv,
        api_key_env=spec.api_key_env if key else None,
        started_at=started_at,
        log=str(log),
    )


async def _rejects_key(url: str, key: str) -> bool:
    async with open_session() as session:
        try:
            await ServerClient(session, url, key, request_timeout_s=10).info()
        except ServerAccessError as e:
            return e.status == 401
        except ServerError:
            return False
    return False


async def _wait_healthy(
    records: list[ServerRecord], key: str | None, timeout_s: float, say: Callable, stop: Event
) -> None:
    async with open_session() as session:
        results = await asyncio.gather(
            *(_wait_one(ServerClient(session, r.url, key), r, key, timeout_s, say, stop) for r in records),
            return_exceptions=True,
        )
    errors = [str(e) for e in results if isinstance(e, BaseException)]
    if errors:
        raise FleetError("\n\n".join(errors))


async def _wait_one(
    client: ServerClient, rec: ServerRecord, key: str | None, timeout_s: float, say: Callable, stop: Event
) -> None:
    """Until the server answers /health, said at once and every WAIT_SAY_EVERY_S; one loading its model refuses
    connections (SGLang binds its port after): only its exit, the timeout or `stop` end this."""
    start = time.monotonic()
    deadline, said = start + timeout_s, None
    while not await client.healthy(timeout=30):
        if said is None or time.monotonic() - said >= WAIT_SAY_EVERY_S:
            said = time.monotonic()
            say(f"waiting for {rec.url}/health ({said - start:.0f} s of {timeout_s:.0f} s) ...")
        if not processes.is_ours(rec.pid, rec.proc_start):
            code = processes.exit_code(rec.pid)
            raise FleetError(
                f"server {rec.name} (pid {rec.pid}, {rec.url}) exited"
                f"{f' with code {code}' if code is not None else ''} before it was healthy. "
                f"Last lines of {rec.log}:\n{processes.tail(Path(rec.log), secrets=(key,) if key else ())}"
            )
        if time.monotonic() > deadline:
            raise FleetError(
                f"server {rec.name} (pid {rec.pid}, {rec.url}) is not healthy after {timeout_s:.0f}s "
                f"(GET /health); it is left running (`dflash fleet down` stops it). Last lines of "
                f"{rec.log}:\n{processes.tail(Path(rec.log), secrets=(key,) if key else ())}"
            )
        if stop.is_set():
            raise FleetError(f"stopped waiting for {rec.url}/health; server {rec.name} is left running")
        await asyncio.sleep(0.5)


def down(
    fleet_dir: Path, names: list[str] | None = None, timeout_s: float = 30.0, on_event: Events = None
) -> list[ServerRecord]:
    """SIGTERM each server's process group, SIGKILL it after `timeout_s`, and drop it from the registry."""
    say = on_event or (lambda _msg: None)
    with registry.locked(fleet_dir):
        records = registry.load(fleet_dir)
        unknown = sorted(set(names or ()) - set(records))
        if unknown:
            raise FleetError(f"not in the fleet registry: {', '.join(unknown)} (known: {', '.join(records) or 'none'})")
        stopped = []
        for name in names or sorted(records):
            rec = records.pop(name)
            processes.stop_group(rec.pid, rec.proc_start, timeout_s)
            registry.save(fleet_dir, records)
            stopped.append(rec)
            say(f"{name}: stopped (pid {rec.pid}, {rec.url})")
    return stopped
