"""Start throwaway redis-server and PostgreSQL instances for the test suite."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

STARTUP_TIMEOUT = 30.0  # seconds to wait for a service to accept connections
PG_VERSION = "15"  #: preferred PostgreSQL major version (what production runs)
PG_ROLE = "scheduler"  #: superuser role and database name in the throwaway cluster
PG_FAST_SETTINGS = {
    # Durability is pointless for a cluster deleted after the run; these make
    # schema creation and commits several times faster.
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    # Acceptance tests run several beat/worker processes, each with connections.
    "max_connections": "200",
}


class ServiceError(RuntimeError):
    """A test service could not be found or started."""


def free_port() -> int:
    """Return a loopback TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_until(ready: Callable[[], bool], alive: Callable[[], bool], what: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if ready():
            return
        if not alive():
            raise ServiceError(f"{what} exited during startup; log tail:\n{_tail(log)}")
        time.sleep(0.05)
    raise ServiceError(f"{what} not ready after {STARTUP_TIMEOUT:.0f}s; log tail:\n{_tail(log)}")


# --- Redis --------------------------------------------------------------------


def find_redis_server() -> str:
    """Return the path of redis-server on PATH, or raise with install advice."""
    path = shutil.which("redis-server")
    if path is None:
        raise ServiceError(
            "redis-server not found on PATH. Install it with `apt-get install redis-server` (Debian/Ubuntu)."
        )
    return path


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Run a private, non-persistent redis-server; yield its redis:// URL."""
    binary = find_redis_server()
    workdir = Path(tempfile.mkdtemp(prefix="scheduler-redis-"))
    port = free_port()
    log = workdir / "redis.log"
    args = [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(workdir),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--logfile",
        str(log),
    ]
    # A new session keeps a Ctrl-C in the terminal from killing the server
    # before our own teardown runs.
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    # No retries: redis-py retries (with backoff) the ConnectionError that a
    # successful SHUTDOWN causes, which would add seconds to every teardown.
    client = redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )

    def ping() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        _wait_until(ping, lambda: proc.poll() is None, "redis-server", log)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        with contextlib.suppress(redis.RedisError):
            client.shutdown(nosave=True)
        client.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# --- PostgreSQL ---------------------------------------------------------------


def find_pg_bindir() -> Path:
    """Return a directory holding initdb and pg_ctl, or raise with install advice.

    Order: $PG_BINDIR, `pg_config --bindir`, /usr/lib/postgresql/*/bin
    (15 first, then newest), then PATH.
    """
    candidates: list[Path] = []
    if os.environ.get("PG_BINDIR"):
        candidates.append(Path(os.environ["PG_BINDIR"]))
    if pg_config := shutil.which("pg_config"):
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))
    versioned = glob.glob("/usr/lib/postgresql/*/bin")
    versioned.sort(key=lambda p: (Path(p).parent.name == PG_VERSION, _major(Path(p).parent.name)), reverse=True)
    candidates += [Path(p) for p in versioned]
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).parent)
    for bindir in candidates:
        if all(os.access(bindir / tool, os.X_OK) for tool in ("initdb", "pg_ctl")):
            return bindir
    raise ServiceError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found via $PG_BINDIR, pg_config, "
        "/usr/lib/postgresql/*/bin or PATH. Install them with "
        "`apt-get install postgresql-15` (Debian/Ubuntu)."
    )


def _major(name: str) -> int:
    return int(name) if name.isdigit() else 0


def _unprivileged_user() -> str:
    """Return a non-root user to own the cluster: initdb and postgres refuse root."""
    for name in ("nobody", "scheduler-test"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "scheduler-test"], check=True
    )
    return "scheduler-test"


def _as_user(user: str | None) -> list[str]:
    """Return the command prefix that drops root privileges (empty when not root)."""
    if user is None:
        return []
    if runuser := shutil.which("runuser"):
        return [runuser, "-u", user, "--"]
    if setpriv := shutil.which("setpriv"):
        return [setpriv, f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--clear-groups", "--"]
    raise ServiceError(
        "running as root, but neither runuser nor setpriv is available "
        "to start PostgreSQL as an unprivileged user (install util-linux)"
    )


def _run(what: str, cmd: list[str], log: Path, cwd: Path, timeout: float) -> None:
    # Output goes to a file, not a pipe: a pipe inherited by the postmaster
    # would keep subprocess.run waiting for EOF forever.
    with log.open("ab") as out:
        result = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
    if result.returncode != 0:
        raise ServiceError(f"{what} failed (exit {result.returncode}); log tail:\n{_tail(log)}")


@contextlib.contextmanager
def postgres_cluster() -> Iterator[str]:
    """Run a throwaway PostgreSQL cluster on loopback; yield a postgres:// URL.

    The role and database are both ``scheduler``; auth is ``trust``.
    """
    bindir = find_pg_bindir()
    user = _unprivileged_user() if os.geteuid() == 0 else None
    prefix = _as_user(user)
    workdir = Path(tempfile.mkdtemp(prefix="scheduler-pg-"))
    data, sockets, log = workdir / "data", workdir / "sockets", workdir / "postgres.log"
    sockets.mkdir()
    if user is not None:
        entry = pwd.getpwnam(user)
        for path in (workdir, sockets):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    port = free_port()
    pg_ctl = [*prefix, str(bindir / "pg_ctl"), "-D", str(data)]
    started = False
    try:
        initdb = [
            *prefix,
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            PG_ROLE,
            "--auth=trust",
            "--no-locale",
            "-E",
            "UTF8",
            "--no-sync",
        ]
        _run("initdb", initdb, workdir / "initdb.log", workdir, 120)
        options = [f"-h 127.0.0.1 -p {port} -k {shlex.quote(str(sockets))}"]
        options += [f"-c {key}={value}" for key, value in PG_FAST_SETTINGS.items()]
        started = True
        start = [*pg_ctl, "-l", str(log), "-w", "-t", str(int(STARTUP_TIMEOUT)), "-o", " ".join(options), "start"]
        _run("pg_ctl start", start, workdir / "pg_ctl.log", workdir, STARTUP_TIMEOUT + 10)
        admin_dsn = f"postgresql://{PG_ROLE}@127.0.0.1:{port}/postgres"

        def connectable() -> bool:
            try:
                with psycopg.connect(admin_dsn, connect_timeout=2):
                    return True
            except psycopg.OperationalError:
                return False

        _wait_until(connectable, lambda: (data / "postmaster.pid").exists(), "postgres", log)
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{PG_ROLE}"')
        yield f"postgres://{PG_ROLE}@127.0.0.1:{port}/{PG_ROLE}"
    finally:
        if started:
            with contextlib.suppress(ServiceError, subprocess.TimeoutExpired):
                stop = [*pg_ctl, "-m", "immediate", "-w", "stop"]
                _run("pg_ctl stop", stop, workdir / "pg_ctl.log", workdir, 30)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    """Start both services, print their URLs and wait for Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the teardowns
    try:
        with redis_server() as redis_url, postgres_cluster() as database_url:
            print(f"REDIS_URL={redis_url}\nDATABASE_URL={database_url}", flush=True)
            print("Services are up; press Ctrl-C to stop them.", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
