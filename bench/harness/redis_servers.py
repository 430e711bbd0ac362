"""Private Redis servers for tests and benchmarks: one `redis-server` that can be killed,
stopped and started again on the same port, and a real Redis Cluster on this machine
(3 masters with a replica each by default, made with `redis-cli --cluster create`)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.crc import key_slot


class RedisProcess:
    """A private redis-server that a test can kill, stop and start again on the same port."""

    def __init__(self, port: int, *extra_args: str):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        # A directory of its own while it runs: a replica's full sync writes an RDB file there, and a
        # server started where another left one loads it first (answering LOADING meanwhile: 150 MB
        # took seconds). Removed when the server is killed, so no run leaves one behind.
        self.dir = tempfile.mkdtemp(prefix=f"iris-redis-{self.port}-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.dir,
        )
        deadline = time.monotonic() + 5
        while True:  # up once the port accepts connections
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


# Short enough that a failover happens within a test, long enough not to trip on a busy machine.
NODE_TIMEOUT_MS = 2000


class RedisClusterProcesses:
    def __init__(self, masters: int = 3, replicas: int = 1):
        self.dir = Path(tempfile.mkdtemp(prefix="iris-redis-cluster-"))
        self.nodes: dict[int, RedisProcess] = {}
        for _ in range(masters * (1 + replicas)):
            port = free_node_port(exclude=self.nodes)
            self.nodes[port] = RedisProcess(
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.dir / f"nodes-{port}.conf"),
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                # The other masters keep serving while one master's slots are uncovered.
                "--cluster-require-full-coverage",
                "no",
                "--dir",
                str(self.dir),
            )
        self.replicas = replicas

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{next(iter(self.nodes))}/0"

    def start(self) -> RedisClusterProcesses:
        try:
            for node in self.nodes.values():
                node.start()
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{p}" for p in self.nodes),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_until(lambda: self.healthy(), 30, "the cluster did not become healthy")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2)

    def cluster_nodes(self) -> list[dict]:
        """CLUSTER NODES as seen by a live node: port, id, role flags, slot ranges."""
        for port, node in self.nodes.items():
            if node.proc is None:
                continue
            try:
                nodes = self.client(port).execute_command("CLUSTER NODES")  # parsed by redis-py
            except redis.RedisError:
                continue
            return [
                {
                    "id": n["node_id"],
                    "port": int(address.split("@")[0].rsplit(":", 1)[1]),
                    "flags": set(n["flags"].split(",")),
                    "master": n["master_id"],
                    "slots": [(int(r[0]), int(r[-1])) for r in n["slots"]],
                }
                for address, n in nodes.items()
            ]
        raise RuntimeError("no live node")

    def masters(self, nodes: list[dict] | None = None) -> list[int]:
        """Ports of the live masters that own slots (of `nodes`, else of CLUSTER NODES now)."""
        return sorted(
            n["port"]
            for n in (nodes or self.cluster_nodes())
            if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"]
        )

    def healthy(self) -> bool:
        try:
            live = [p for p, n in self.nodes.items() if n.proc is not None]
            infos = [self.client(p).execute_command("CLUSTER INFO") for p in live]
            nodes = self.cluster_nodes()
        except (redis.RedisError, RuntimeError):
            return False
        ok = all(info["cluster_state"] == "ok" for info in infos)  # parsed by redis-py
        replicas = [n for n in nodes if "slave" in n["flags"] and "fail" not in n["flags"]]
        return ok and len(self.masters(nodes)) == len(live) - len(replicas) == len(self.nodes) // (1 + self.replicas)

    def replica_of(self, master_port: int) -> int:
        nodes = self.cluster_nodes()
        master_id = next(n["id"] for n in nodes if n["port"] == master_port)
        return next(n["port"] for n in nodes if n["master"] == master_id)

    def kill(self, port: int) -> None:
        self.nodes[port].kill()

    def port_of_key(self, key: str) -> int:
        slot = key_slot(key.encode())
        for n in self.cluster_nodes():
            if "master" not in n["flags"] or "fail" in n["flags"]:
                continue
            if any(lo <= slot <= hi for lo, hi in n["slots"]):
                return n["port"]
        raise LookupError(key)

    @staticmethod
    def wait_until(condition, timeout_s: float, message: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(message)
            time.sleep(0.1)


def free_node_port(exclude) -> int:
    """A port that is free with its cluster-bus port (port + 10000): the kernel's ephemeral
    ports are too high for that, so pick below them."""
    while True:
        port = random.randrange(20000, 30000)
        if port in exclude or port + 10000 in exclude:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
