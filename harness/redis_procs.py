"""Redis processes on loopback ports: a server, a Sentinel deployment, a Redis Cluster.

Used by the tests (``tests.redis_fixture``) and the benchmarks (``bench.redis_ha_bench``).
Readiness is awaited by PINGing (authenticated where a password is set), never by sleeping
a fixed time.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import tempfile
import time

from harness.procs import free_port as _free_port

__all__ = ["ClusterSet", "RedisServer", "SentinelSet", "TlsFiles"]


def _ping(
    port: int,
    timeout: float = 0.2,
    password: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
            s = raw if tls is None else tls.wrap_socket(raw, server_hostname="localhost")
            if password is not None:
                s.sendall(f"AUTH {password}\r\n".encode())
                if not s.recv(16).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class TlsFiles:
    """A CA and a server certificate (``certs.dev_bundle``) for TLS-only Redis processes,
    and optionally a client certificate the processes present when they dial each other
    (a Cluster's bus always asks for one)."""

    def __init__(
        self,
        ca: str,
        cert: str,
        key: str,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        self.ca, self.cert, self.key = ca, cert, key
        self.client_cert, self.client_key = client_cert, client_key

    def server_args(self, port: int) -> list[str]:
        client = (
            ["--tls-client-cert-file", self.client_cert, "--tls-client-key-file", self.client_key]
            if self.client_cert is not None and self.client_key is not None
            else []
        )
        return [
            "--port", "0", "--tls-port", str(port),
            "--tls-cert-file", self.cert, "--tls-key-file", self.key,
            "--tls-ca-cert-file", self.ca, "--tls-auth-clients", "no",
            "--tls-replication", "yes", *client,
        ]  # fmt: skip

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)


class RedisServer:
    """A private ``redis-server`` process on a loopback port that stays the same across
    ``kill``/``start`` (so clients can reconnect to the same URL)."""

    def __init__(
        self,
        executable: str,
        extra_args: list[str] | None = None,
        *,
        password: str | None = None,
        config: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        """
        Args:
            extra_args: more ``redis-server`` options (``--replicaof``, ``--sentinel``...).
            password: what the readiness PING authenticates with.
            config: a config file's text, written to the server's directory and passed
                first (Sentinel needs a file it can rewrite); ``{port}`` is replaced.
            tls: serve TLS only (``tls-port``, plain port 0), replicate and reach the
                other nodes over TLS; the readiness PING verifies the certificate.
        """
        self.executable = executable
        self.port = 0
        self.extra_args = list(extra_args or [])
        self.password = password
        self.config = config
        self.tls = tls
        self._dir = tempfile.TemporaryDirectory(prefix="continuum-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        """Start (again) on ``self.port``; pick a free port on first start. Waits for PONG."""
        attempts = 1 if self.port else 5
        for _ in range(attempts):
            if not self.port or attempts > 1:
                self.port = _free_port()
            head: list[str] = []
            if self.config is not None:
                path = os.path.join(self._dir.name, "redis.conf")
                with open(path, "w") as f:
                    f.write(self.config.replace("{port}", str(self.port)))
                head = [path]
            self._proc = subprocess.Popen(
                [
                    self.executable,
                    *head,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self._dir.name,
                    "--daemonize",
                    "no",
                    "--loglevel",
                    "warning",
                    *self.extra_args,
                    *(self.tls.server_args(self.port) if self.tls is not None else ()),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break  # exited: the port was taken meanwhile, try another
                ctx = self.tls.client_context() if self.tls is not None else None
                if _ping(self.port, password=self.password, tls=ctx):
                    return
                time.sleep(0.02)
            self.kill()
        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}")

    def kill(self) -> None:
        """SIGKILL and reap: connections drop at once, nothing is saved."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()


class SentinelSet:
    """A primary, a replica and three sentinels on loopback ports (see the module doc).

    ``master_name`` is what the sentinels monitor; ``password`` the data nodes',
    ``sentinel_password`` the sentinels' own. :meth:`wait_ready` blocks until every
    sentinel knows the replica and the two other sentinels (so a failover can be
    agreed on); :meth:`kill_primary` and :meth:`wait_failover` drive a failover.
    """

    master_name = "continuum"
    password = "data-secret"
    sentinel_password = "sentinel-secret"

    def __init__(self, executable: str, tls: TlsFiles | None = None) -> None:
        """``tls``: every process (data nodes and sentinels) speaks TLS only."""
        self.tls = tls
        auth = ["--requirepass", self.password, "--masterauth", self.password]
        self.primary = RedisServer(executable, auth, password=self.password, tls=tls)
        self.primary.start()
        self.replica = RedisServer(
            executable,
            [*auth, "--replicaof", "127.0.0.1", str(self.primary.port)],
            password=self.password,
            tls=tls,
        )
        self.replica.start()
        conf = "\n".join(
            (
                f"sentinel monitor {self.master_name} 127.0.0.1 {self.primary.port} 2",
                f"sentinel auth-pass {self.master_name} {self.password}",
                f"sentinel down-after-milliseconds {self.master_name} 1000",
                f"sentinel failover-timeout {self.master_name} 4000",
                f"sentinel parallel-syncs {self.master_name} 1",
                f"requirepass {self.sentinel_password}",
                f"sentinel sentinel-pass {self.sentinel_password}",
                "",
            )
        )
        self.sentinels: list[RedisServer] = []
        for _ in range(3):
            s = RedisServer(
                executable, ["--sentinel"], password=self.sentinel_password, config=conf, tls=tls
            )
            s.start()
            self.sentinels.append(s)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def config(self) -> dict[str, object]:
        """``response_cache.redis`` for this deployment (Sentinel mode, both passwords)."""
        tls = self.tls is not None
        return {
            "mode": "sentinel",
            "password": self.password,
            **({"tls": True, "tls_ca_file": self.tls.ca} if self.tls is not None else {}),
            "sentinel": {
                "master_name": self.master_name,
                "addresses": self.addresses,
                "password": self.sentinel_password,
                "tls": tls,
            },
        }

    def _sentinel(self, port: int, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(port), "-a", self.sentinel_password, "--no-auth-warning",
             *(["--tls", "--cacert", self.tls.ca] if self.tls is not None else []),
             "sentinel", *args],
            capture_output=True, text=True, timeout=5, check=False,
        )  # fmt: skip
        return out.stdout

    def master_port(self, sentinel_port: int | None = None) -> int | None:
        """The primary's port as a sentinel names it."""
        port = self.sentinels[0].port if sentinel_port is None else sentinel_port
        lines = self._sentinel(port, "get-master-addr-by-name", self.master_name).split()
        return int(lines[1]) if len(lines) == 2 else None

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for s in self.sentinels:
                info = self._sentinel(s.port, "master", self.master_name).split("\n")
                fields = dict(zip(info[::2], info[1::2], strict=False))
                if fields.get("num-slaves") != "1" or fields.get("num-other-sentinels") != "2":
                    ok = False
                    break
            if ok:
                return
            time.sleep(0.1)
        raise RuntimeError("the sentinels did not find the replica and each other")

    def kill_primary(self) -> int:
        """SIGKILL the current primary; returns its port."""
        port = self.master_port()
        victim = self.primary if port == self.primary.port else self.replica
        victim.kill()
        return victim.port

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Until every sentinel names a new primary; its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ports = {self.master_port(s.port) for s in self.sentinels}
            if len(ports) == 1 and None not in ports and old_port not in ports:
                (port,) = ports
                assert port is not None
                return port
            time.sleep(0.1)
        raise RuntimeError("no failover")

    def close(self) -> None:
        for s in (*self.sentinels, self.replica, self.primary):
            s.close()


class ClusterSet:
    """A Redis Cluster of three primaries and three replicas on loopback ports.

    Every node is a ``redis-server --cluster-enabled yes`` with ``password`` on data and
    replication, a ``node_timeout_ms`` (1 s) node timeout so a killed primary's replica is
    promoted within a few seconds, and its cluster bus on a port of its own
    (``--cluster-port``), kept with the node's ``nodes.conf`` across :meth:`kill` /
    :meth:`restart`, so a restarted node rejoins as itself. ``redis-cli --cluster create``
    assigns the slots and the replicas; :meth:`wait_ready` blocks until every node says
    ``cluster_state:ok`` and sees all six nodes connected, and every replica has synced
    (one that never did is never promoted).
    """

    password = "cluster-secret"
    node_timeout_ms = 1000

    def __init__(self, executable: str, size: int = 3, tls: TlsFiles | None = None) -> None:
        """``tls``: every node serves TLS only, and the cluster bus and replication use it."""
        self.tls = tls
        self.nodes: list[RedisServer] = []
        self._primaries_before: set[int] = set()
        for _ in range(2 * size):
            bus = _free_port()
            node = RedisServer(
                executable,
                [
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--cluster-port", str(bus),
                    "--requirepass", self.password, "--masterauth", self.password,
                    *(["--tls-cluster", "yes"] if tls is not None else []),
                ],
                password=self.password,
                tls=tls,
            )  # fmt: skip
            node.port = _free_port()
            self.nodes.append(node)
        try:
            for node in self.nodes:
                node.start()
            out = subprocess.run(
                ["redis-cli", "-a", self.password, "--no-auth-warning", *self._cli_tls(),
                 "--cluster", "create", *self.addresses, "--cluster-replicas", "1",
                 "--cluster-yes"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{n.port}" for n in self.nodes]

    def _cli_tls(self) -> list[str]:
        return ["--tls", "--cacert", self.tls.ca] if self.tls is not None else []

    def config(self) -> dict[str, object]:
        """``response_cache.redis`` for this deployment (Cluster mode, every node listed)."""
        return {
            "mode": "cluster",
            "password": self.password,
            **({"tls": True, "tls_ca_file": self.tls.ca} if self.tls is not None else {}),
            "cluster": {"startup_nodes": self.addresses},
        }

    def cli(self, port: int, *args: str) -> str:
        """``redis-cli`` against one node; its stdout ("" when the node is down)."""
        out = subprocess.run(
            ["redis-cli", "-p", str(port), "-a", self.password, "--no-auth-warning",
             *self._cli_tls(), *args],
            capture_output=True, text=True, timeout=5, check=False,
        )  # fmt: skip
        return out.stdout

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def _view(self, port: int) -> list[tuple[int, list[str], str]]:
        """``CLUSTER NODES`` as one node sees it: (port, flags, link state) per node."""
        rows = []
        for line in self.cli(port, "cluster", "nodes").splitlines():
            f = line.split()
            if len(f) >= 8:
                addr = f[1].split("@")[0]
                rows.append((int(addr.rsplit(":", 1)[1]), f[2].split(","), f[7]))
        return rows

    def primaries(self) -> list[int]:
        """Ports of the primaries a running node knows and does not consider failed."""
        for n in self.nodes:
            if n.running:
                rows = self._view(n.port)
                if rows:
                    return sorted(
                        p for p, flags, _ in rows if "master" in flags and "fail" not in flags
                    )
        return []

    def primary_for(self, key: str) -> int:
        """The port of the primary that serves ``key``'s slot now."""
        live = next(n for n in self.nodes if n.running)
        slot = int(self.cli(live.port, "cluster", "keyslot", key).strip())
        for row in self.cli(live.port, "cluster", "nodes").splitlines():
            f = row.split()
            if len(f) < 9 or "master" not in f[2] or "fail" in f[2]:
                continue
            for rng in f[8:]:
                if rng.startswith("["):
                    continue  # a slot being migrated
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return int(f[1].split("@")[0].rsplit(":", 1)[1])
        raise RuntimeError(f"no primary serves slot {slot}")

    def _ok(self, port: int, expect: int) -> bool:
        if "cluster_state:ok" not in self.cli(port, "cluster", "info"):
            return False
        repl = self.cli(port, "info", "replication")
        if "role:slave" in repl and "master_link_status:up" not in repl:
            return False  # a replica that never synced refuses to be promoted
        rows = self._view(port)
        return len(rows) == expect and all(
            link == "connected" or "myself" in flags
            for _, flags, link in rows
            if "fail" not in flags and "noaddr" not in flags
        )

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until every running node says ``cluster_state:ok`` and knows all nodes, and
        every replica's link to its primary is up.

        The bound is generous: on two loaded cores (the whole suite beside a session-wide
        cluster) gossip and the replicas' first sync took over 30 s once. The error says
        which node was not ready and what it reported, so a failure explains itself.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._ok(n.port, len(self.nodes)) for n in self.nodes if n.running):
                return
            time.sleep(0.1)
        report = []
        for n in self.nodes:
            if n.running and not self._ok(n.port, len(self.nodes)):
                info = self.cli(n.port, "cluster", "info").splitlines()[:1]
                link = [
                    line
                    for line in self.cli(n.port, "info", "replication").splitlines()
                    if line.startswith(("role:", "master_link_status:"))
                ]
                report.append(f"{n.port}: {info + link} view={self._view(n.port)}")
        raise RuntimeError(
            "the cluster did not reach cluster_state:ok on every node: " + "; ".join(report)
        )

    def kill(self, port: int) -> None:
        """SIGKILL one node (its slots stay unserved until its replica takes over)."""
        self._primaries_before = set(self.primaries())
        self.node(port).kill()

    def restart(self, port: int) -> None:
        """Start a killed node again on its ports; it rejoins (as a replica if it was
        replaced meanwhile)."""
        self.node(port).start()

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Until the running nodes agree that ``old_port`` failed and serve all slots
        again; returns the port of the replica promoted in its place."""
        before = self._primaries_before
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.running]
            ok = all(
                "cluster_state:ok" in self.cli(n.port, "cluster", "info") for n in live
            ) and all(
                any(p == old_port and "fail" in flags for p, flags, _ in self._view(n.port))
                for n in live
            )
            if ok:
                new = set(self.primaries()) - before
                if len(new) == 1:
                    return new.pop()
            time.sleep(0.1)
        raise RuntimeError(f"no failover of the primary on port {old_port}")

    def close(self) -> None:
        for n in self.nodes:
            n.close()
