"""The instance and the data a command works on, set in the environment before Dagster is imported: the definitions
read them at load."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dflash_assets.cli.errors import BadInput
from dflash_assets.settings import Deployment, EnvSetting

# the project's instance settings (telemetry and the community modal off, the run queue, the fleet's pool)
PROJECT_DAGSTER_YAML = Path(__file__).resolve().parents[2] / "dagster_home" / "dagster.yaml"


def instance_environment(args: argparse.Namespace) -> None:
    """The instance, the data dir and its prompt source, set in the environment before Dagster is imported (the
    definitions read them at load, store/in_use.py): a flag, else its variable, else what the instance and the data
    dir remember. A data dir that cannot be written and a fleet that cannot work are refused here (exit 2)."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path("dagster_home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    _set_up_instance(home)
    if getattr(args, "data_dir", None):
        os.environ[Deployment.DATA_DIR.name] = args.data_dir
    if args.prompts:
        os.environ[Deployment.PROMPTS.name] = str(Path(args.prompts).resolve())
    if getattr(args, "shard_size", None):
        os.environ[Deployment.SHARD_SIZE.name] = str(args.shard_size)
    if getattr(args, "servers", None):
        os.environ[Deployment.NUM_SERVERS.name] = str(args.servers)
    from dflash_assets.store.in_use import data_in_use

    data = data_in_use()
    for name, value in data.environment().items():
        os.environ.setdefault(name, value)
    _readable_source(Path(data.prompts), "--prompts" if args.prompts else data.prompts_from)
    from dflash_assets.store.storage import write_refusal

    if refused := write_refusal(data.data_dir) or (args.subcommand != "export" and fleet_refusal()):
        raise BadInput(refused)


FLEET_CHECK_S = 1.5  # how long an attached server has to answer the check (a slow one is the run's to wait for)


def fleet_refusal() -> str | None:
    """Why the attached fleet cannot work (nothing listens, 401/403/404), with the fix, or None; slow is waited for."""
    if Deployment.FLEET_MODE.value() != "attach":
        return None
    import asyncio

    from dflash_assets.fleet.attach import parse_urls
    from dflash_assets.fleet.client import ServerAccessError, ServerClient
    from dflash_assets.fleet.fleet import open_session, run

    urls = parse_urls(Deployment.FLEET_URLS.value())  # a malformed URL: AttachError, exit 2 (cli/errors.py)

    async def problems() -> list:
        async with open_session() as session:
            clients = [ServerClient(session, url, Deployment.API_KEY.value() or None, FLEET_CHECK_S) for url in urls]
            return await asyncio.gather(*(c.health_problem(FLEET_CHECK_S) for c in clients))

    for url, problem in zip(urls, run(problems()), strict=True):
        if getattr(problem, "kind", None) == "refused":
            return (
                f"nothing listens at {url} (the connection was refused): start the servers, or set "
                f"{Deployment.FLEET_URLS.name} to where they listen"
            )
        if isinstance(problem, ServerAccessError) and problem.status in (401, 403):
            return f"{url} refuses GET /health (HTTP {problem.status}): set {Deployment.API_KEY.name} to its API key"
        if isinstance(problem, ServerAccessError):
            return (
                f"{url} answers GET /health with HTTP {problem.status}, as no SGLang server or gateway does: set "
                f"{Deployment.FLEET_URLS.name} to their base URLs"
            )
    return None


def data_dir_of(args: argparse.Namespace) -> str:
    """The data dir of a command that only reads one (store/in_use.py), set in the environment."""
    from dflash_assets.store.in_use import data_in_use

    if getattr(args, "data_dir", None):
        os.environ[Deployment.DATA_DIR.name] = args.data_dir
    home = {"DAGSTER_HOME": str(Path("dagster_home").resolve())}  # the commands' instance when none is set
    os.environ[Deployment.DATA_DIR.name] = data_in_use(home | dict(os.environ)).data_dir
    return os.environ[Deployment.DATA_DIR.name]


def _set_up_instance(home: Path) -> None:
    """An empty DAGSTER_HOME gets the project's dagster.yaml, said in one line (Dagster would warn and default)."""
    if not PROJECT_DAGSTER_YAML.is_file() or any(home.iterdir()):
        return  # an instance already there keeps its own settings; an installed wheel has no project file
    (home / "dagster.yaml").write_text(PROJECT_DAGSTER_YAML.read_text())
    print(f"DAGSTER_HOME={home} was empty: wrote the project's dagster.yaml there")
    print("    (telemetry off, the run queue, the fleet's concurrency pool)")


def _readable_source(path: Path, given_by: str) -> None:
    """A prompt source that cannot be read stops the command at once, saying which and how to fix it."""
    from dflash_assets.generation.prompts import SourceError, check_source

    try:
        check_source(path)
    except SourceError as e:
        raise BadInput(f"{e} (given by {given_by}): give a JSONL or Parquet file of prompts") from None


def _differing(settings: list[EnvSetting]) -> list[tuple[str, str]]:
    """The deployment settings that differ from their defaults, as (variable, value); never the API key."""
    from dflash_assets.store.storage import is_uri

    found = []
    for setting in settings:
        value = os.environ.get(setting.name)
        if setting is Deployment.API_KEY or value is None or value == setting.default:
            continue
        if setting in (Deployment.DATA_DIR, Deployment.LOCAL_DIR, Deployment.PROMPTS) and not is_uri(value):
            value = str(Path(value).resolve())
        found.append((setting.name, value))
    return found


DEPLOYMENT = [s for s in vars(Deployment).values() if isinstance(s, EnvSetting)]
DATA = (Deployment.DATA_DIR, Deployment.PROMPTS)  # given as flags (DATA_FLAGS); the rest in the environment
DATA_FLAGS = ("data-dir", "prompts")
SETTING_FLAGS = {"--servers": Deployment.NUM_SERVERS, "--shard-size": Deployment.SHARD_SIZE}  # a flag the command has


def launcher() -> str:
    """How the user started this command: `uv run ` when uv did (it sets UV_RUN_RECURSION_DEPTH), else ""."""
    return "uv run " if os.environ.get("UV_RUN_RECURSION_DEPTH") else ""


def as_printed(command: str, prompts: bool = True) -> str:
    """`command` (`dflash <cmd> [flags]`) as it runs again as printed on this command's data: its launcher, its
    --data-dir and (`prompts`) --prompts in place of any it carried, and before it every deployment setting (and
    DAGSTER_HOME) that differs from its default."""
    import shlex

    data = dict(_differing(list(DATA)))
    given = [
        f"--{flag} {shlex.quote(data[s.name])}"
        for s, flag in zip(DATA, DATA_FLAGS)
        if s.name in data and (prompts or flag != "prompts")
    ]
    words = _without(shlex.split(command), [f"--{flag}" for flag in DATA_FLAGS])
    given_by_flags = [s for flag, s in SETTING_FLAGS.items() if any(w.split("=")[0] == flag for w in words)]
    return " ".join(
        filter(
            None,
            [
                _prefix([s for s in DEPLOYMENT if s not in (*DATA, *given_by_flags)]),
                launcher() + shlex.join(words),
                *given,
            ],
        )
    )


def _without(words: list[str], flags: list[str]) -> list[str]:
    """`words` without the `flags` (`--flag value` or `--flag=value`): the printed command gives them once."""
    kept: list[str] = []
    skip = False
    for word in words:
        if skip or word.split("=", 1)[0] in flags:
            skip = not skip and word in flags
            continue
        kept.append(word)
    return kept


def ui_command() -> str:
    """The UI's command on this command's instance and data dir, with the settings that differ from their defaults."""
    import shutil

    known = (Deployment.PROMPTS, Deployment.SHARD_SIZE)
    start = launcher() or ("" if shutil.which("dg") else "uv run ")  # `dg` beside a `dflash` on PATH, else uv's
    return f"{_prefix([s for s in DEPLOYMENT if s not in known], home=True)} {start}dg dev"


def _prefix(settings: list[EnvSetting], home: bool = False) -> str:
    """`NAME=value ...` of the settings that differ (DAGSTER_HOME too: always for the UI, which has no default)."""
    import shlex

    pairs = _differing(settings)
    dagster_home = os.environ.get("DAGSTER_HOME")
    if dagster_home and (home or Path(dagster_home).resolve() != Path("dagster_home").resolve()):
        pairs.insert(0, ("DAGSTER_HOME", str(Path(dagster_home).resolve())))
    return " ".join(f"{name}={shlex.quote(value)}" for name, value in pairs)
