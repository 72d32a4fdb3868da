"""The service shapes the benchmarks run against, started and removed by the command itself.

- ``embedded``: `nightshift serve` (SQLite, local folder, filesystem broker) in a temp home;
- ``services``: a new Postgres database, a Redis database, moto's S3 server (its own process,
  so it does not share the benchmark's GIL), uvicorn with two workers, one engine worker and
  one cpu worker with beat: the production shape on one machine.

For fault injection (``bench.chaos``, ``tests/service/test_faults.py``): ``PostgresServer`` (a
Postgres cluster of its own, initdb + pg_ctl on a temporary folder and a free port, restartable
and stoppable; the machine's own server is never touched), ``RedisServer`` (a redis-server of its
own, restartable, nothing persisted), ``MotoServer`` (moto in its own process, pausable with
SIGSTOP/SIGCONT) and ``cluster()``, the production shape on those three with every process (API,
engine workers, cpu worker, upkeep worker + beat) killable and restartable.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import httpx

from nightshift.workers import procs

PG_ADMIN_URL = os.environ.get("NIGHTSHIFT_BENCH_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("NIGHTSHIFT_BENCH_REDIS_URL", "redis://127.0.0.1:6379/5")


# free_port's ports: below Linux's ephemeral range (32768-60999 by default), which the kernel hands
# to outgoing connections and to bind(0) (the latter only one parity of them), so no client socket
# takes a port between its pick and the server's bind
PORT_RANGE = (10000, 32768)


def free_port() -> int:
    """A local port nothing is bound to now, at random from PORT_RANGE. Under pytest-xdist only a
    port of this worker's own residue (port % workers == its index): the port is free only until a
    server binds it, so two workers starting servers at once could both be handed it, and one
    test's health check then answered by the other worker's server (a suite failure seen once: a
    fresh key refused with 401 by an API on another database)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = (int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0) % workers
    low, high = PORT_RANGE
    while True:
        port = random.randrange(-(-low // workers), high // workers) * workers + index
        if port >= high:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def wait_http(url: str, proc: Optional[subprocess.Popen] = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


@contextlib.contextmanager
def postgres_database(admin_url: str = PG_ADMIN_URL) -> Iterator[str]:
    """A new, empty Postgres database (dropped afterwards)."""
    import sqlalchemy as sa

    name = f"nightshift_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        from nightshift.storage.db import dispose_engines

        dispose_engines()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextlib.contextmanager
def redis_database(url: str = REDIS_URL) -> Iterator[str]:
    """A Redis database, emptied before and after."""
    import redis

    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()


@contextlib.contextmanager
def moto_s3(log_dir: Path) -> Iterator[tuple[str, str]]:
    """moto's S3 server in its own process; yields (endpoint, bucket)."""
    import boto3

    port = free_port()
    log = open(log_dir / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_http(endpoint, proc, timeout=60)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                     aws_secret_access_key="bench").create_bucket(Bucket="nightshift-bench")
        yield endpoint, "nightshift-bench"
    finally:
        procs.stop(proc, timeout=10)


@dataclass
class RunningService:
    base_url: str
    api_key: str
    home: Path
    database_url: Optional[str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)


def _start(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "wb")
    return subprocess.Popen(argv, env=env, cwd=procs.REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@contextlib.contextmanager
def running_service(shape: str, *, api_workers: int = 2, **settings: object) -> Iterator[RunningService]:
    """The whole service in ``shape`` ("embedded" or "services"), stopped and removed afterwards.
    ``settings`` become NIGHTSHIFT_* variables of every process."""
    work = Path(tempfile.mkdtemp(prefix="nightshift-bench-"))
    home = work / "home"
    home.mkdir()
    port = free_port()
    key = "ns-bench-" + uuid.uuid4().hex
    started: dict[str, subprocess.Popen] = {}
    try:
        with contextlib.ExitStack() as stack:
            if shape == "embedded":
                env = procs.service_env(home=home, bootstrap_key=key, **settings)
                started["serve"] = _start("serve", [sys.executable, "-m", "nightshift.api.cli", "serve", "--port", str(port),
                                                    "--log-level", "warning"], env, work)
                database_url = None
            elif shape == "services":
                database_url = stack.enter_context(postgres_database())
                broker = stack.enter_context(redis_database())
                endpoint, bucket = stack.enter_context(moto_s3(work))
                env = procs.service_env(home=home, bootstrap_key=key, database_url=database_url, broker_url=broker,
                                        object_store="s3", s3_bucket=bucket, s3_endpoint_url=endpoint,
                                        s3_access_key_id="bench", s3_secret_access_key="bench",
                                        s3_addressing_style="path", **settings)
                # one metrics directory for the API's workers, so that /metrics adds them up
                env["PROMETHEUS_MULTIPROC_DIR"] = str(work / "metrics")
                (work / "metrics").mkdir()
                subprocess.run([sys.executable, "-m", "nightshift.api.cli", "migrate"], env=env, cwd=procs.REPO, check=True,
                               capture_output=True)
                started["api"] = _start("api", [sys.executable, "-m", "uvicorn", "nightshift.api.app:create_app", "--factory",
                                                "--workers", str(api_workers), "--host", "127.0.0.1", "--port",
                                                str(port), "--log-level", "warning"], env, work)
                # nice 10, as `nightshift serve` runs it: on one machine the engine stands in for a
                # separate engine host and must not take the API's CPU.
                started["gpu"] = procs.start_worker(env, "gpu", "bench-gpu", work / "gpu.log", nice=10)
                started["cpu"] = procs.start_worker(env, "cpu,upkeep", "bench-cpu", work / "cpu.log", beat=True)
            else:
                raise ValueError(f"unknown shape {shape!r}")
            front = started.get("serve") or started["api"]
            wait_http(f"http://127.0.0.1:{port}/health", front)
            try:
                yield RunningService(f"http://127.0.0.1:{port}/v1", key, home, database_url, started)
            finally:
                for proc in started.values():
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGTERM)
                for proc in started.values():
                    procs.stop(proc, timeout=15)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- restartable pieces, for fault injection -------------------------------------------------

def postgres_bin() -> Path:
    """The folder of the installed Postgres server's programs (initdb, pg_ctl): pg_config's, else
    the newest of /usr/lib/postgresql/*/bin."""
    found = shutil.which("pg_config")
    if found:
        result = subprocess.run([found, "--bindir"], capture_output=True, text=True)
        folder = Path(result.stdout.strip())
        if result.returncode == 0 and (folder / "pg_ctl").exists():
            return folder
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)
                        if p.parent.name.isdigit() else 0)
    if not candidates:
        raise RuntimeError("no Postgres server programs (initdb, pg_ctl) found")
    return candidates[-1]


class PostgresServer:
    """A Postgres cluster of our own: ``initdb`` into a new temporary folder, ``pg_ctl`` on a free
    port (TCP on 127.0.0.1, its socket in that folder), trust authentication, user ``postgres``.
    Faults: ``restart()`` (``pg_ctl restart -m fast``: sessions are ended, the server is back in
    a second or so), ``outage(seconds)`` (``pg_ctl stop -m immediate``, a crash: no shutdown
    checkpoint, crash recovery at the next start; down for ``seconds``). As root (initdb refuses
    to run as root) the programs run as the ``postgres`` system user, which owns the folder."""

    def __init__(self, port: Optional[int] = None):
        self.port = port or free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="nightshift-pg-"))
        self.data = self.folder / "data"
        self.log_path = self.folder / "postgres.log"
        self.bin = postgres_bin()
        self.starts = 0
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.folder, "postgres", "postgres")

    def _run(self, program: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        argv = [str(self.bin / program), *args]
        if self._as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        result = subprocess.run(argv, capture_output=True, text=True, cwd=self.folder)
        if check and result.returncode:
            raise RuntimeError(f"{program} {' '.join(args)} failed ({result.returncode}):\n{result.stdout}"
                               f"{result.stderr}\n{self.log_tail()}")
        return result

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def admin_url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def init(self) -> "PostgresServer":
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\n"
                       f"unix_socket_directories = '{self.folder}'\nmax_connections = 200\n")
        return self.start()

    def start(self, timeout: float = 60.0) -> "PostgresServer":
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", str(int(timeout)), "start")
        self.starts += 1
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def restart(self) -> None:
        """A fast restart: open sessions are ended, the server is back as soon as it has started."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-l", str(self.log_path), "-w", "restart")
        self.starts += 1

    def outage(self, seconds: float) -> None:
        """Crash it (immediate stop), stay down ``seconds``, start it again (crash recovery)."""
        self.stop("immediate")
        time.sleep(seconds)
        self.start()

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PostgresServer]:
    """A ``PostgresServer``, started; removed afterwards."""
    server = PostgresServer().init()
    try:
        yield server
    finally:
        server.remove()


class RedisServer:
    """A redis-server of our own on a free port, with no persistence (``--save "" --appendonly
    no``): a restart comes back empty, every queued or unacknowledged message lost, as a broker
    that crashed without an append-only file does."""

    def __init__(self, log_dir: Path, port: Optional[int] = None):
        self.log_dir = log_dir
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> "RedisServer":
        import redis

        with open(self.log_dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--dir", str(self.log_dir),
                                          "--protected-mode", "no"],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}")
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"redis-server on port {self.port} did not answer") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: whatever it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            procs.kill_group(self.proc)

    def restart(self, down_seconds: float = 0.0) -> None:
        """Kill it, stay down ``down_seconds``, start it again empty on the same port."""
        self.kill()
        time.sleep(down_seconds)
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            procs.stop(self.proc, timeout=10)


class MotoServer:
    """moto's S3 server in its own process group, which can be paused (SIGSTOP) and resumed
    (SIGCONT): a stalled object store, as a partition or an overloaded endpoint looks to a
    client (the kernel still accepts connections; nothing answers)."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.paused = False
        with open(log_dir / "moto.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(self.endpoint, self.proc, timeout=60)

    def client(self):  # noqa: ANN201
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="bench",
                            aws_secret_access_key="bench")

    def new_bucket(self) -> str:
        name = f"nightshift-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
        procs.stop(self.proc, timeout=10)


def parent_pid(pid: int) -> Optional[int]:
    """The parent of a live process (Linux /proc), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


WORKER_QUEUES = {"cpu": "cpu", "upkeep": "upkeep"}   # engine workers ("engine1", ...) take "gpu"


@dataclass
class Cluster:
    """The production shape on one machine with every process restartable: a Postgres cluster of
    its own (``postgres``, restartable), a redis-server of its own, moto in its own process, uvicorn (the API), engine
    workers ``engine1..N`` (queue gpu, -c 1, nice 10, ``engine_threads`` torch threads each), a
    ``cpu`` worker and an ``upkeep`` worker with beat. Each process is its own process group
    (``kill`` SIGKILLs a worker with its pool child, uvicorn with its workers); ``start``
    starts a fresh one (a worker under a new node name), as a supervisor would."""

    work: Path
    env: dict[str, str]
    database_url: str
    redis: RedisServer
    s3: MotoServer
    bucket: str
    api_port: int
    api_key: str
    postgres: Optional[PostgresServer] = None
    api_workers: int = 2
    engine_workers: int = 2
    engine_threads: Optional[int] = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    _log_offsets: dict[str, int] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/v1"

    @property
    def engines(self) -> list[str]:
        return [f"engine{i + 1}" for i in range(self.engine_workers)]

    @property
    def worker_names(self) -> list[str]:
        return [*self.engines, "cpu", "upkeep"]

    def settings(self):  # noqa: ANN201 - nightshift.settings.Settings
        """The settings every process of the cluster runs with (for this process's own database,
        object store and broker calls)."""
        from nightshift.settings import Settings

        prefix = "NIGHTSHIFT_"
        return Settings(**{k[len(prefix):].lower(): v for k, v in self.env.items()
                           if k.startswith(prefix) and k != "NIGHTSHIFT_MODEL_CACHE"})

    def log_path(self, name: str) -> Path:
        return self.work / f"{name}.log"

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def start(self, name: str) -> subprocess.Popen:
        """Start (or start again) one process of the cluster; does not wait for it."""
        old = self.processes.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self.starts[name] = self.starts.get(name, 0) + 1
        log_path = self.log_path(name)
        self._log_offsets[name] = log_path.stat().st_size if log_path.exists() else 0
        if name == "api":
            with open(log_path, "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "nightshift.api.app:create_app", "--factory",
                                         "--workers", str(self.api_workers), "--host", "127.0.0.1", "--port",
                                         str(self.api_port), "--log-level", "warning"],
                                        env=self.env, cwd=procs.REPO, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        elif name in self.engines:
            env = self.env if self.engine_threads is None else {**self.env, "OMP_NUM_THREADS": str(self.engine_threads)}
            proc = procs.start_worker(env, "gpu", f"{name}-{self.starts[name]}", log_path, nice=10)
        else:
            proc = procs.start_worker(self.env, WORKER_QUEUES[name], f"{name}-{self.starts[name]}", log_path,
                                      beat=name == "upkeep")
        self.processes[name] = proc
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL the process and its whole group (a worker's pool child, uvicorn's workers)."""
        proc = self.processes[name]
        if proc.poll() is None:
            procs.kill_group(proc)
        else:   # its children may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def restart(self, name: str) -> subprocess.Popen:
        self.kill(name)
        return self.start(name)

    def alive(self, name: str) -> bool:
        proc = self.processes.get(name)
        return proc is not None and proc.poll() is None

    def ready(self, name: str) -> bool:
        """The API answers /health, or the worker's log shows "ready" since its last start."""
        if name == "api":
            try:
                return httpx.get(f"http://127.0.0.1:{self.api_port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        path = self.log_path(name)
        if not path.exists():
            return False
        with open(path, "rb") as f:
            f.seek(self._log_offsets.get(name, 0))
            return b" ready." in f.read()

    def wait_ready(self, names: Optional[list[str]] = None, timeout: float = 180.0) -> None:
        names = list(names or ["api", *self.worker_names])
        deadline = time.monotonic() + timeout
        while names:
            for name in list(names):
                if not self.alive(name):
                    raise RuntimeError(f"{name} exited:\n{self.log(name)}")
                if self.ready(name):
                    names.remove(name)
            if names and time.monotonic() > deadline:
                raise TimeoutError(f"{names} not ready after {timeout}s")
            time.sleep(0.2)

    def worker_of(self, pid: int) -> Optional[str]:
        """The live cluster process that ``pid`` is (or whose pool child it is)."""
        for candidate in (pid, parent_pid(pid)):
            for name, proc in self.processes.items():
                if candidate is not None and proc.pid == candidate and proc.poll() is None:
                    return name
        return None

    def owner_of_lease(self, lease_owner: Optional[str]) -> Optional[str]:
        """The cluster process holding a lease (``lease_owner`` is "host:pid" of the pool child)."""
        if not lease_owner or ":" not in lease_owner:
            return None
        pid = lease_owner.rsplit(":", 1)[1]
        return self.worker_of(int(pid)) if pid.isdigit() else None

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes.values():
            procs.stop(proc, timeout=15)


@contextlib.contextmanager
def cluster(work: Optional[Path] = None, *, engine_workers: int = 2, api_workers: int = 2,
            engine_threads: Optional[int] = None, keep_work: bool = False, **settings: object) -> Iterator[Cluster]:
    """``Cluster``, started and ready; stopped afterwards. ``work`` holds the logs (a temporary
    folder, removed afterwards unless ``keep_work``); ``settings`` become NIGHTSHIFT_* variables
    of every process; ``engine_threads`` sets OMP_NUM_THREADS of the engine workers (engine
    workers sharing one machine's cores would otherwise each start a thread per core). The
    database is on a Postgres cluster of the cluster's own (``private_postgres``), so that faults
    can restart it."""
    made = work is None
    work = Path(tempfile.mkdtemp(prefix="nightshift-cluster-")) if made else Path(work)
    work.mkdir(parents=True, exist_ok=True)
    key = "ns-bench-" + uuid.uuid4().hex
    try:
        with contextlib.ExitStack() as stack:
            postgres = stack.enter_context(private_postgres())
            database_url = stack.enter_context(postgres_database(postgres.admin_url()))
            redis_server = RedisServer(work).start()
            stack.callback(redis_server.stop)
            s3 = MotoServer(work)
            stack.callback(s3.stop)
            bucket = s3.new_bucket()
            home = work / "home"
            home.mkdir(exist_ok=True)
            env = procs.service_env(home=home, bootstrap_key=key, database_url=database_url,
                                    broker_url=redis_server.url, object_store="s3", s3_bucket=bucket,
                                    s3_endpoint_url=s3.endpoint, s3_access_key_id="bench",
                                    s3_secret_access_key="bench", s3_addressing_style="path", **settings)
            migrate = subprocess.run([sys.executable, "-m", "nightshift.api.cli", "migrate"], env=env, cwd=procs.REPO,
                                     capture_output=True, text=True)
            if migrate.returncode:
                raise RuntimeError(f"nightshift migrate failed:\n{migrate.stdout}{migrate.stderr}")
            running = Cluster(work, env, database_url, redis_server, s3, bucket, free_port(), key, postgres,
                              api_workers=api_workers, engine_workers=engine_workers, engine_threads=engine_threads)
            stack.callback(running.stop)
            for name in ["api", *running.worker_names]:
                running.start(name)
            running.wait_ready()
            yield running
    finally:
        if made and not keep_work:
            shutil.rmtree(work, ignore_errors=True)
