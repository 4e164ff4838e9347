"""A worker alive but deaf: ``manage.py alive --role worker`` fails while it consumes nothing, and passes once it does.

Real worker processes on a Redis broker of their own, which the test stops,
starts again on the same port, or cuts off behind a proxy while the worker
process stays up. The check is what a container healthcheck runs.
"""

from __future__ import annotations

import io
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.support.processes import ROOT, CeleryProcess, wait_until
from tests.support.services import find_redis_server, free_port

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]

#: Seconds between a worker's probes (its heartbeat interval) in these tests.
PROBE_SECONDS = 1
#: ``alive --within``: the newest broker round trip must be younger than this.
WITHIN = 5
#: The stated bound: a worker that stopped consuming fails the check within
#: WITHIN + PROBE_SECONDS; the rest is slack for two cores shared with other suites.
DEAF_BOUND = WITHIN + PROBE_SECONDS + 10
#: After the broker answers again, a worker that recovers by itself passes again within this.
RECOVERY_SECONDS = 60


def _alive() -> str | None:
    """Run ``alive --role worker`` in this process; return its error, or None when it passed."""
    try:
        call_command("alive", role="worker", within=WITHIN, stdout=io.StringIO())
    except CommandError as error:
        return str(error)
    return None


def _alive_command(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py alive --role worker`` as a healthcheck does: its own process, exit status, output."""
    argv = [sys.executable, "manage.py", "alive", "--role", "worker", "--within", str(WITHIN)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def private_broker(process_env: dict[str, str]) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Point child processes at a redis-server of their own; return ``start()``, which (re)starts it empty."""
    port = free_port()
    argv = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    url = f"redis://127.0.0.1:{port}/0"
    process_env.update(REDIS_URL=url, TEST_RUNS_REDIS_URL=process_env["REDIS_URL"])
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(proc)
        assert wait_until(lambda: _pings(url), timeout=10), "the broker did not start"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(5)


class FreezableProxy:
    """A TCP relay to a local port; ``freeze()`` stops relaying on every connection open then, ``thaw()`` resumes.

    A frozen connection stays open but silent both ways, as across a network
    path that drops everything for a while: its client waits for a reply
    that does not come. Connections made after the freeze are relayed as usual.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.frozen: set[socket.socket] = set()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.closed:
                    client.close()
                    upstream.close()
                    return
                self.sockets += [client, upstream]
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(client, source, target), daemon=True).start()

    def _pump(self, client: socket.socket, source: socket.socket, target: socket.socket) -> None:
        try:
            while True:
                if client in self.frozen:
                    time.sleep(0.1)
                    continue
                if not select.select([source], [], [], 0.1)[0]:
                    continue
                data = source.recv(65536)
                if not data:
                    break
                target.sendall(data)
        except (OSError, ValueError):
            pass  # closed: by the peer, or by close() (select() raises ValueError on a closed socket)
        for sock in (source, target):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def freeze(self) -> None:
        with self.lock:
            self.frozen.update(self.sockets[::2])

    def thaw(self) -> None:
        with self.lock:
            self.frozen.clear()

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            self.closed = True
            for sock in self.sockets:
                sock.close()


def _send_echo(broker_url: str) -> str:
    """Send a plain ``scheduler.echo`` (no execution) through ``broker_url``; return its task id."""
    app = Celery("deaf-worker-test", broker=broker_url, set_as_current=False)
    task_id = str(uuid.uuid4())
    try:
        app.send_task("scheduler.echo", args=["deaf"], task_id=task_id)
    finally:
        app.close()
    return task_id


def test_broker_restart__alive_fails_while_the_worker_cannot_consume_and_passes_once_it_does(
    celery_processes: Start, private_broker: Callable[[], subprocess.Popen[bytes]], process_env: dict[str, str]
) -> None:
    # Given a worker on a broker of its own, probing every second
    broker = private_broker()
    worker = celery_processes("worker", "deaf1", concurrency=1, claim_renew_seconds=PROBE_SECONDS)
    worker.wait_for_log(r"ready\.", timeout=60)
    # whose check passes, as a healthcheck runs it
    assert wait_until(lambda: _alive() is None, timeout=30), _alive()
    healthy = _alive_command(process_env)
    assert healthy.returncode == 0, healthy.stderr

    # When the broker stops, while the worker process stays up
    broker.kill()
    broker.wait(5)
    stopped = time.monotonic()

    # Then the check fails within the bound, naming why, though the process is alive
    assert wait_until(lambda: _alive() is not None, timeout=DEAF_BOUND, interval=0.5), (
        f"alive still passes {DEAF_BOUND}s after the broker stopped; worker log:\n{worker.log()[-3000:]}"
    )
    took = time.monotonic() - stopped
    assert worker.alive(), f"the worker exited instead of waiting for the broker:\n{worker.log()[-3000:]}"
    deaf = _alive_command(process_env)
    assert deaf.returncode == 1, (deaf.returncode, deaf.stdout, deaf.stderr)
    lines = deaf.stderr.strip().splitlines()
    assert len(lines) == 1 and "broker" in lines[0] and "probe" in lines[0], deaf.stderr
    print(f"alive failed {took:.1f}s after the broker stopped: {lines[0]}")

    # When the broker is started again on the same port, empty
    private_broker()
    answered = time.monotonic()

    # Then the worker consumes again by itself and its check passes again
    restarts: list[CeleryProcess] = []

    def passes() -> bool:
        nonlocal worker
        if not worker.alive():
            # kombu 5.7's Redis transport can crash a worker whose broker
            # vanished; the check fails while it is down (asserted here), and
            # its supervisor starts it again, as here.
            assert _alive() is not None, "alive passed with the worker down"
            worker = celery_processes(
                "worker", f"deaf{len(restarts) + 2}", concurrency=1, claim_renew_seconds=PROBE_SECONDS
            )
            restarts.append(worker)
        return _alive() is None

    assert wait_until(passes, timeout=RECOVERY_SECONDS, interval=0.5), (
        f"alive still fails {RECOVERY_SECONDS}s after the broker answered: {_alive()}\n{worker.log()[-3000:]}"
    )
    print(f"alive passed again {time.monotonic() - answered:.1f}s after the broker answered; restarts: {len(restarts)}")
    # and a message sent now is consumed and run
    task_id = _send_echo(process_env["REDIS_URL"])
    worker.wait_for_log(rf"scheduler\.echo\[{task_id}\] succeeded", timeout=30)


def test_busy_worker__prefetch_window_full__alive_passes(
    celery_processes: Start, private_broker: Callable[[], subprocess.Popen[bytes]], process_env: dict[str, str]
) -> None:
    # Given a worker with one pool process, probing every second
    private_broker()
    worker = celery_processes("worker", "busy1", concurrency=1, claim_renew_seconds=PROBE_SECONDS)
    worker.wait_for_log(r"ready\.", timeout=60)
    assert wait_until(lambda: _alive() is None, timeout=30), _alive()

    # When more long tasks arrive than it may reserve: its prefetch window
    # (1 process x 4, acknowledged late) is full, and the rest wait in the broker
    app = Celery("busy-worker-test", broker=process_env["REDIS_URL"], set_as_current=False)
    try:
        for _ in range(8):
            app.send_task("scheduler.sleep", args=[8])
    finally:
        app.close()
    client = redis.Redis.from_url(process_env["REDIS_URL"])
    try:
        assert wait_until(lambda: client.llen("celery") == 4, timeout=30), client.llen("celery")

        # Then, for twice the check's window, it takes no further task, yet its check passes: busy is not deaf
        deadline = time.monotonic() + 2 * WITHIN
        while time.monotonic() < deadline:
            assert _alive() is None, f"{_alive()}\n{worker.log()[-3000:]}"
            assert client.llen("celery") >= 2, "the window freed up before the check was watched long enough"
            time.sleep(0.5)
    finally:
        client.close()


def test_silent_broker_connection__alive_fails_while_nothing_is_consumed_and_passes_once_it_answers(
    celery_processes: Start, private_broker: Callable[[], subprocess.Popen[bytes]], process_env: dict[str, str]
) -> None:
    # Given a worker that reaches its broker through a relay, probing every second
    private_broker()
    broker_url = process_env["REDIS_URL"]
    proxy = FreezableProxy(int(broker_url.rsplit(":", 1)[1].split("/")[0]))
    process_env["REDIS_URL"] = f"redis://127.0.0.1:{proxy.port}/0"
    client = redis.Redis.from_url(broker_url)
    try:
        worker = celery_processes("worker", "deaf1", concurrency=1, claim_renew_seconds=PROBE_SECONDS)
        worker.wait_for_log(r"ready\.", timeout=60)
        assert wait_until(lambda: _alive() is None, timeout=30), _alive()

        # When every connection it has open goes silent, while the broker itself answers
        proxy.freeze()
        frozen = time.monotonic()

        # Then the check fails within the bound, though the process is alive
        assert wait_until(lambda: _alive() is not None, timeout=DEAF_BOUND, interval=0.5), (
            f"alive still passes {DEAF_BOUND}s after the connections went silent; worker log:\n{worker.log()[-3000:]}"
        )
        print(f"alive failed {time.monotonic() - frozen:.1f}s after the freeze: {_alive()}")
        assert worker.alive(), worker.log()[-3000:]
        # and a task sent now waits in the broker: the worker is deaf, not dead
        task_id = _send_echo(broker_url)
        time.sleep(2)
        assert client.llen("celery") == 1, "the task was taken while the worker's connections were silent"
        assert _alive() is not None

        # When the connections carry traffic again
        proxy.thaw()
        thawed = time.monotonic()

        # Then the worker consumes again by itself and its check passes again
        assert wait_until(lambda: _alive() is None, timeout=RECOVERY_SECONDS, interval=0.5), (
            f"alive still fails: {_alive()}\n{worker.log()[-3000:]}"
        )
        print(f"alive passed again {time.monotonic() - thawed:.1f}s after the thaw")
        worker.wait_for_log(rf"scheduler\.echo\[{task_id}\] succeeded", timeout=60)
    finally:
        client.close()
        proxy.close()
