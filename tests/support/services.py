"""Throwaway Postgres and Redis servers for the multi-machine tests: Debian's packages (`postgresql`,
`redis-server`, installed by scripts/test.sh), started once per test session on loopback ports in temporary
directories, stopped at the end.

Postgres refuses to run as root, so when the tests run as root (CI) its data directory belongs to the `postgres`
user the Debian package creates, and initdb / pg_ctl run as that user through `runuser`.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_assets.emulator.process import free_port


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    user: str
    password: str
    db: str  # the maintenance database initdb creates

    def connect(self, db: str):
        import psycopg2

        return psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password, dbname=db)

    def database(self, db: str) -> dict[str, str]:
        """A new, empty database (one per test module: instances never share runs), and the DAGSTER_PG_* settings
        deploy/dagster.yaml reads to use it."""
        conn = self.connect(self.db)
        conn.autocommit = True
        with conn.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {db}")
        conn.close()
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": db,
        }


@contextmanager
def environ(settings: dict[str, str]) -> Iterator[None]:
    """`settings` in this process's environment (and so in every process it starts), restored after."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _pg_bin(name: str) -> str:
    # Debian keeps the server binaries out of PATH, under /usr/lib/postgresql/<major>/bin
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name)]
    if not found[-1]:
        raise RuntimeError(f"{name} not found: install Debian's postgresql (scripts/test.sh does, as root)")
    return found[-1]


def _as_owner(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextmanager
def postgres_server(log_path: Path) -> Iterator[Postgres]:
    """initdb into a temporary directory, start on a free loopback port with password auth."""
    base = Path(tempfile.mkdtemp(prefix="dflash-pg-"))
    data, pwfile = base / "data", base / "pwfile"
    server = Postgres("127.0.0.1", free_port(), "dagster", secrets.token_hex(12), "postgres")
    pwfile.write_text(server.password + "\n")
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
        shutil.chown(pwfile, "postgres", "postgres")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pg_log = base / "postgres.log"  # written by the postgres user; copied to log_path at the end
    try:
        subprocess.run(
            _as_owner(
                [
                    _pg_bin("initdb"),
                    "-D",
                    str(data),
                    "-U",
                    server.user,
                    f"--pwfile={pwfile}",
                    "--auth=scram-sha-256",
                    "-E",
                    "UTF8",
                ]
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        options = f"-c listen_addresses={server.host} -p {server.port} -k {base} -c fsync=off"
        subprocess.run(
            _as_owner(
                [_pg_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(pg_log), "-w", "-t", "60", "start"]
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        yield server
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(e.cmd)} failed:\n{e.stdout}\n{e.stderr}") from None
    finally:
        subprocess.run(
            _as_owner([_pg_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
            capture_output=True,
            check=False,
        )
        if pg_log.exists():
            shutil.copy(pg_log, log_path)
        shutil.rmtree(base, ignore_errors=True)


@dataclass(frozen=True)
class Redis:
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextmanager
def redis_server(log_path: Path) -> Iterator[Redis]:
    """redis-server on a free loopback port, no persistence, in a temporary directory."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        raise RuntimeError("redis-server not found: install Debian's redis-server (scripts/test.sh does, as root)")
    base = Path(tempfile.mkdtemp(prefix="dflash-redis-"))
    server = Redis(free_port())
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(server.port),
                "--dir",
                str(base),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=server.port)
        deadline = time.monotonic() + 30
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start (exit {proc.poll()}); see {log_path}") from None
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
