"""Real ``redis-server`` processes for the Redis store's tests, on free loopback ports.

``RedisServer`` runs one server (optionally with ``requirepass``, TLS, extra settings); it can be
stopped, restarted on the same port, paused (SIGSTOP, a stalled server) and resumed.
``RedisClusterNodes`` starts three cluster-enabled servers and joins them with
``redis-cli --cluster create``. ``running_server`` / ``running_cluster`` are context managers
that stop every process they started, whatever happens. Nothing here is mocked: the binaries
come from Debian's ``redis-server`` / ``redis-tools`` (``scripts/install_system_deps.sh``).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
OPENSSL = shutil.which("openssl")

needs_redis = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (bash scripts/install_system_deps.sh installs it)")


def free_port(*, with_bus: bool = False) -> int:
    """A loopback TCP port nobody listens on (and port + 10000 too, for a cluster bus)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair found")


def _answers_ping(port: int, password: str | None, tls: dict[str, Path] | None) -> bool:
    import redis

    kwargs: dict[str, object] = {"port": port, "password": password, "socket_timeout": 0.5,
                                 "socket_connect_timeout": 0.5}
    if tls:
        kwargs.update(ssl=True, ssl_ca_certs=str(tls["ca"]))
    try:
        with redis.Redis(**kwargs) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


class RedisServer:
    """One redis-server on 127.0.0.1, without persistence, logging into ``workdir``."""

    def __init__(self, workdir: Path, *, password: str | None = None, port: int | None = None,
                 extra: Sequence[str] = (), tls: dict[str, Path] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.port = port or free_port(with_bus=any("cluster-enabled" in a for a in extra))
        self.extra = list(extra)
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls["cert"]), "--tls-key-file", str(self.tls["key"]),
                     "--tls-ca-cert-file", str(self.tls["ca"]), "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + timeout_s
        while not _answers_ping(self.port, self.password, self.tls):
            if self.process.poll() is not None or time.monotonic() > end:
                log = (self.workdir / "redis.log")
                tail = log.read_text()[-2000:] if log.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)  # a paused server must wake up to exit
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """Stop the process (SIGSTOP): connections stay open but nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def url(self, *, db: int = 0, user: str = "", password: str | None = None,
            query: str = "") -> str:
        password = self.password if password is None else password
        auth = f"{user}:{password}@" if password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def client(self):  # a redis-py client for the test's own checks
        import redis

        kwargs: dict[str, object] = {"port": self.port, "password": self.password}
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls["ca"]))
        return redis.Redis(**kwargs)


@contextlib.contextmanager
def running_server(workdir: Path, **kwargs: object) -> Iterator[RedisServer]:
    server = RedisServer(workdir, **kwargs)  # type: ignore[arg-type]
    try:
        yield server.start()
    finally:
        server.stop()


def make_tls_material(workdir: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (needs the openssl binary)."""
    assert OPENSSL is not None
    workdir.mkdir(parents=True, exist_ok=True)
    ca, ca_key = workdir / "ca.pem", workdir / "ca.key"
    cert, key, csr = workdir / "server.pem", workdir / "server.key", workdir / "server.csr"
    ext = workdir / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *curve, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=kvtier-test-ca"],
        ["req", *curve, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", ext],
    ]
    for step in steps:
        subprocess.run([OPENSSL, *map(str, step)], check=True, capture_output=True)
    return {"ca": ca, "cert": cert, "key": key}


class RedisClusterNodes:
    """Three cluster-enabled servers holding all 16384 slots (no replicas)."""

    def __init__(self, workdir: Path, nodes: int = 3) -> None:
        self.servers = [
            RedisServer(workdir / f"node{i}", extra=["--cluster-enabled", "yes",
                                                     "--cluster-config-file", "nodes.conf",
                                                     "--cluster-node-timeout", "2000"])
            for i in range(nodes)]

    def start(self, timeout_s: float = 20.0) -> RedisClusterNodes:
        assert REDIS_CLI is not None
        for server in self.servers:
            server.start()
        addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
        end = time.monotonic() + timeout_s
        while not all(self._cluster_ok(s) for s in self.servers):
            if time.monotonic() > end:
                raise RuntimeError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    @staticmethod
    def _cluster_ok(server: RedisServer) -> bool:
        with server.client() as client:
            info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text and "cluster_slots_assigned:16384" in text

    def url(self, query: str = "") -> str:
        extra = f"&{query}" if query else ""
        return f"redis://127.0.0.1:{self.servers[0].port}/0?cluster=true{extra}"

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@contextlib.contextmanager
def running_cluster(workdir: Path) -> Iterator[RedisClusterNodes]:
    cluster = RedisClusterNodes(workdir)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
