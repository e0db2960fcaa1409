"""Security: Redis with ``requirepass``, with an ACL user confined to the namespace, and over TLS; the
CLI and workers connect with the URL and never log the password; metrics bind to loopback by default;
no module of the pipeline unpickles or evaluates code."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis

from pipeline.transport.connection import mask_url
from pipeline.transport.keys import Keys
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout
from tests.redis_server import RedisServer, free_port
from tests.reliability.harness import FAST_ENV, report
from tests.reliability.tls import TLSRedis, make_certs

pytestmark = [pytest.mark.reliability, pytest.mark.redis, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cr3t-" + os.urandom(6).hex()
SPECIAL = "p@ss:w/rd#1 %x?&=" + os.urandom(4).hex()  # needs percent-encoding in a URL


def cli(args: list[str], url: str | None, namespace: str, *, env: dict[str, str] | None = None,
        timeout: float = 60.0) -> tuple[int, str]:
    """``distillq ARGS`` as a process (URL by flag, or by ``DISTILLQ_REDIS_URL`` when ``url`` is None)."""
    argv = [sys.executable, "-m", "pipeline.cli.main", *args, "--namespace", namespace]
    if url is not None:
        argv += ["--redis-url", url]
    p = subprocess.run(argv, env={**os.environ, **FAST_ENV, **(env or {})}, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, check=False)
    return p.returncode, p.stdout + p.stderr


def pipeline_round_trip(url: str | None, namespace: str, tmp: Path, env: dict[str, str] | None = None
                        ) -> tuple[list[int], str]:
    """push -> teacher --burst -> feeder --burst -> stats/tail: exit codes and all output."""
    f = tmp / "one.jsonl"
    f.write_text(json.dumps(to_atropos(synthetic_rollout(2, 8, prompt_len=3, group_id="g1"))) + "\n")
    steps = [["push", str(f)], ["worker", "teacher", "--backend", "synthetic", "--burst"],
             ["worker", "feeder", "--burst", "--max-wait", "0"], ["stats", "--json"], ["tail", "batches", "--json"]]
    codes, out = [], ""
    for step in steps:
        code, text = cli(step, url, namespace, env=env)
        codes.append(code)
        out += text
    return codes, out


def stop_or_kill(proc: subprocess.Popen[str], grace_s: float = 30.0) -> str:
    """Output of ``proc`` after SIGTERM; SIGKILL (and fail) if it does not stop within ``grace_s``."""
    try:
        return proc.communicate(timeout=grace_s)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"worker did not stop within {grace_s:.0f} s of SIGTERM: {out[-1500:]}") from None


def leaked(text: str, *secrets: str) -> list[str]:
    return [s for s in secrets for form in (s, urllib.parse.quote(s, safe="")) if form in text]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["requirepass_flag", "requirepass_env", "acl_user"])
def test_authenticated_urls_work_and_passwords_never_reach_output(how: str, tmp_path: Path) -> None:
    ns = f"sec{os.urandom(3).hex()}"
    server = RedisServer(password=PASSWORD if how != "acl_user" else None).start()
    try:
        if how == "acl_user":  # confined to the namespace, no dangerous commands; default user off
            admin = redis.Redis.from_url(server.url)
            admin.execute_command("ACL", "SETUSER", "distill", "on", ">" + SPECIAL, "resetkeys", f"~{{{ns}:*",
                                  f"~{ns}:*", "resetchannels", "+@all", "-@dangerous")
            admin.execute_command("ACL", "SETUSER", "default", "off")
            admin.close()
            secret = SPECIAL
            url = f"redis://distill:{urllib.parse.quote(SPECIAL, safe='')}@127.0.0.1:{server.port}/0"
        else:
            secret, url = PASSWORD, server.url
        env = {"DISTILLQ_REDIS_URL": url} if how == "requirepass_env" else None
        codes, out = pipeline_round_trip(None if env else url, ns, tmp_path, env)
        client = redis.Redis.from_url(url)
        batches = client.xlen(Keys(ns).stream("batches"))
        denied = None
        if how == "acl_user":
            try:
                client.get("other-namespace:secret")
            except redis.exceptions.NoPermissionError as e:
                denied = str(e)
        client.close()
        wrong_code, wrong_out = cli(["stats"], url.replace(urllib.parse.quote(secret, safe=""), "wrong-" + secret[:3]),
                                    ns)
    finally:
        server.stop()
    # Redis gone: a worker retrying its connection logs errors, never the URL's password.
    worker = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "worker", "feeder", "--namespace", ns,
                               "--redis-url", url], env={**os.environ, **FAST_ENV}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3.0)
    worker.send_signal(signal.SIGTERM)
    down_out = stop_or_kill(worker)
    masked_logged = '"redis": "redis://' in out and ":***@" in out
    report(f"security_{how}", exit_codes=codes, batches=batches, output_bytes=len(out + wrong_out + down_out),
           password_leaks=len(leaked(out + wrong_out + down_out, secret)), url_logged_masked=masked_logged,
           wrong_password_exit=wrong_code, outside_namespace_denied=denied is not None)
    assert codes == [0] * 5, out[-3000:]
    assert batches == 1, out[-6000:]
    assert not leaked(out, secret) and not leaked(wrong_out, secret) and not leaked(down_out, secret)
    assert masked_logged, "workers should log the Redis URL, masked"
    assert wrong_code != 0 and ("invalid" in wrong_out.lower() or "auth" in wrong_out.lower())
    assert "connect" in down_out.lower()  # it reported the failure (see test_redis_crash for the restart)
    if how == "acl_user":
        assert denied is not None and "permission" in denied.lower()


@pytest.mark.slow
def test_tls_rediss_url(tmp_path: Path) -> None:
    ca, cert, key = make_certs(tmp_path)
    server = TLSRedis(ca=ca, cert=cert, key=key)
    try:
        server.start()
    except RuntimeError as e:
        if "tls" in str(e).lower() or "directive" in str(e).lower():
            pytest.skip(f"this redis-server has no TLS support: {str(e)[-300:]}")
        raise
    ns = f"tls{os.urandom(3).hex()}"
    url = f"rediss://127.0.0.1:{server.port}/0"
    try:
        codes, out = pipeline_round_trip(url, ns, tmp_path, {"DISTILLQ_SSL_CA_CERTS": str(ca)})
        batches = redis.Redis.from_url(server.url).xlen(Keys(ns).stream("batches"))
        no_ca_code, no_ca_out = cli(["stats"], url, ns, timeout=30)
    finally:
        server.stop()
    report("security_tls", exit_codes=codes, batches=batches, without_ca_exit=no_ca_code)
    assert codes == [0] * 5, out[-3000:]
    assert batches == 1
    assert no_ca_code != 0 and "certificate verify failed" in no_ca_out.lower()  # it really verifies


class ResettingEndpoint:
    """Accepts TCP connections and resets them at once: a load balancer whose Redis is down, or a
    plaintext client talking to a TLS port."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_cli_fails_fast_when_redis_resets_connections() -> None:
    endpoint = ResettingEndpoint()
    t0 = time.monotonic()
    try:
        code, out = cli(["stats"], f"redis://127.0.0.1:{endpoint.port}/0", "reset", timeout=10)
    finally:
        endpoint.close()
    report("security_reset_endpoint", exit_code=code, seconds=time.monotonic() - t0, accepted=endpoint.accepted)
    assert code != 0 and "connection" in out.lower()


def listening(port: int) -> list[str]:
    """Hex local addresses of LISTEN sockets on ``port`` (/proc/net/tcp and tcp6)."""
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(path).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if int(hexport, 16) == port and state == "0A":
                out.append(addr)
    return out


def other_address() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent
        except OSError:
            return None
        addr = str(s.getsockname()[0])
    return None if addr.startswith("127.") else addr


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def start_with_metrics(url: str, ns: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "pipeline.cli.main", "worker", "teacher", "--backend", "synthetic",
            "--redis-url", url, "--namespace", ns, "--metrics-port", str(port), *extra]
    proc = subprocess.Popen(argv, env={**os.environ, **FAST_ENV}, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while time.monotonic() < end and not listening(port):
        time.sleep(0.1)
    return proc


def test_metrics_bind_to_loopback_by_default(private_redis: RedisServer) -> None:
    ns = f"met{os.urandom(3).hex()}"
    other = other_address()
    default_port, exposed_port = free_port(), free_port()
    default = start_with_metrics(private_redis.url, ns, default_port)
    exposed = start_with_metrics(private_redis.url, ns, exposed_port, "--metrics-host", "0.0.0.0")
    try:
        default_addrs, exposed_addrs = listening(default_port), listening(exposed_port)
        with urllib.request.urlopen(f"http://127.0.0.1:{default_port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
        default_remote = reachable(other, default_port) if other else None
        exposed_remote = reachable(other, exposed_port) if other else None
    finally:
        for p in (default, exposed):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    report("security_metrics", default_listen=default_addrs, default_reachable_on_other_address=default_remote,
           explicit_0000_listen=exposed_addrs, explicit_reachable_on_other_address=exposed_remote,
           other_address=other)
    assert default_addrs == ["0100007F"], default_addrs  # 127.0.0.1 only, no IPv6 wildcard
    assert "distillq_" in body
    assert exposed_addrs == ["00000000"]  # the check can see an exposed endpoint
    if other is not None:
        assert default_remote is False and exposed_remote is True


BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "jsonpickle"}
BANNED_CALLS = {"eval", "exec"}


def unsafe_constructs(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            kwargs = {k.arg: k.value for k in node.keywords}
            if isinstance(fn, ast.Name) and name in BANNED_CALLS | {"__import__"}:
                found.append(f"{where} {name}()")
            elif name == "load" and isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and (
                    fn.value.id == "torch" and not _is_true(kwargs.get("weights_only"))):
                found.append(f"{where} torch.load without weights_only=True (unpickles)")
            elif _is_true(kwargs.get("allow_pickle")) or _is_true(kwargs.get("shell")):
                found.append(f"{where} {name}(allow_pickle/shell=True)")
    return found


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def test_no_module_unpickles_or_evaluates_code() -> None:
    files = [p for d in ("schemas", "pipeline", "workers") for p in sorted((ROOT / d).rglob("*.py"))]
    found = [f for p in files for f in unsafe_constructs(p)]
    report("security_static", files_checked=len(files), unsafe_constructs=len(found))
    assert len(files) > 30
    assert not found, found


@pytest.mark.parametrize("url", [f"redis://127.0.0.1:6399/0?password={PASSWORD}",
                                 f"redis://:{PASSWORD}/x@127.0.0.1:6399/0"], ids=["query_string", "unencoded_slash"])
def test_mask_url_hides_every_password_form(url: str) -> None:
    assert PASSWORD not in mask_url(url)
