"""A real 3-master Redis Cluster on loopback for tests (redis-server --cluster-enabled + redis-cli)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field

import redis

from tests.redis_server import RedisServer, free_port


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too and within range."""
    import socket

    for _ in range(200):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class LocalCluster:
    masters: int = 3
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> LocalCluster:
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli not found")
        for _ in range(self.masters):
            port = cluster_port()
            node = RedisServer(port=port, extra_args=["--cluster-enabled", "yes", "--cluster-config-file",
                                                      f"nodes-{port}.conf", "--cluster-node-timeout", "2000",
                                                      "--appendonly", "yes", "--appendfsync", "always"])
            self.nodes.append(node.start())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = [redis.Redis(port=n.port).cluster("info") for n in self.nodes]
                if all(s.get("cluster_state") == "ok" for s in states):  # type: ignore[union-attr]
                    return
            except redis.exceptions.ConnectionError:
                pass
            time.sleep(0.2)
        raise RuntimeError("cluster did not become ok")

    def node_for_key(self, key: str) -> RedisServer:
        """The master that owns ``key``'s slot."""
        any_node = next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)
        slot = int(redis.Redis(port=any_node.port).cluster("keyslot", key))  # type: ignore[arg-type]
        for start, end, master, *_ in redis.Redis(port=any_node.port).cluster("slots"):  # type: ignore[union-attr]
            if start <= slot <= end:
                port = int(master[1])
                return next(n for n in self.nodes if n.port == port)
        raise KeyError(slot)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
