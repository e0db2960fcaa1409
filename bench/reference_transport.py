"""The reference system's transport, reproduced for ``bench.run``: JSON over HTTP to an in-memory queue.

Server (a separate uvicorn process, as there): FastAPI app holding a Python list; a request middleware
gunzips ``Content-Encoding: gzip`` bodies; ``POST /scored_data`` validates the body with a pydantic
model of nested lists (distill arrays ``[seq][pos][k+1]``, entry 0 empty) and appends it; ``GET /batch``
returns whole groups once ``batch_seqs`` sequences are queued, gzip level 9 (``GZipMiddleware``,
minimum 1000 bytes), else ``{"batch": null}``.

Client (this process): an environment thread builds the JSON (``bench.codec.reference_json``), gzips
it at level 9 and POSTs it; the trainer thread GETs ``/batch`` and turns the groups back into numpy.
Requirements: ``fastapi>=0.110``, ``uvicorn>=0.29`` (plus ``httpx``, already a dependency).
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel

from bench.codec import reference_arrays, reference_json
from schemas.build import synthetic_scored


class ScoredData(BaseModel):
    """The reference ``ScoredDataGroup`` as its server validated it (nested lists)."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    inference_logprobs: list[list[float]] | None = None
    generation_params: dict[str, Any] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None


def make_app(batch_seqs: int) -> Any:
    """The reference API server: in-memory queue, gzip both ways."""
    from fastapi import FastAPI
    from fastapi.middleware.gzip import GZipMiddleware
    from starlette.datastructures import MutableHeaders
    from starlette.types import Message, Receive, Scope, Send

    class GZipRequest:
        """Decompress gzip request bodies (as the reference's GZipRequestMiddleware)."""

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            headers = MutableHeaders(scope=scope) if scope["type"] == "http" else None
            if headers is None or "gzip" not in headers.get("content-encoding", ""):
                await self.app(scope, receive, send)
                return
            chunks, more = [], True
            while more:
                msg = await receive()
                chunks.append(msg.get("body", b""))
                more = msg.get("more_body", False)
            body = gzip.decompress(b"".join(chunks))
            headers["content-length"] = str(len(body))
            del headers["content-encoding"]
            sent = False

            async def replay() -> Message:
                nonlocal sent
                out = {"type": "http.request", "body": b"" if sent else body, "more_body": False}
                sent = True
                return out

            await self.app(scope, replay, send)

    app = FastAPI()
    app.add_middleware(GZipMiddleware, minimum_size=1000)
    app.add_middleware(GZipRequest)
    queue: list[dict[str, Any]] = []

    @app.get("/")
    async def root() -> dict[str, str]:
        return {"message": "reference"}

    @app.post("/scored_data")
    async def scored_data(data: ScoredData) -> dict[str, str]:
        queue.append({name: getattr(data, name) for name in ScoredData.model_fields})
        return {"status": "received"}

    @app.get("/batch")
    async def batch() -> dict[str, Any]:
        if sum(len(g["tokens"]) for g in queue) < batch_seqs:
            return {"batch": None}
        out, n = [], 0
        while queue and n < batch_seqs:
            out.append(queue.pop(0))
            n += len(out[-1]["tokens"])
        return {"batch": out}

    return app


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + sys) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class ReferenceRun:
    groups: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


class ReferenceServer:
    """The reference server as a uvicorn subprocess on a free port."""

    def __init__(self, batch_seqs: int) -> None:
        from tests.redis_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "bench.reference_transport", "--port", str(self.port),
               "--batch-seqs", str(batch_seqs)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/", timeout=1.0).raise_for_status()
                return
            except httpx.HTTPError as e:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read() if self.proc.stderr else b""
                    raise RuntimeError(f"reference server exited: {err[-2000:]!r}") from e
                time.sleep(0.1)
        raise RuntimeError("reference server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def run_reference(seqs: int, seq_len: int, k: int, groups: int, batch_groups: int) -> ReferenceRun:
    """Push ``groups`` scored groups through the reference transport; time until all reach the trainer."""
    from bench.common import VOCAB, Workload

    scored = synthetic_scored(Workload(seqs, seq_len, k).rollout(), k, vocab=VOCAB)
    server = ReferenceServer(batch_groups * seqs)
    errors: list[BaseException] = []

    def environment() -> None:
        try:
            with httpx.Client(timeout=600) as http:
                for _ in range(groups):
                    body = gzip.compress(reference_json(scored), compresslevel=9)  # >= 1 KB: gzip 9
                    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
                    http.post(server.url + "/scored_data", content=body, headers=headers).raise_for_status()
        except BaseException as e:  # reported by the trainer side
            errors.append(e)

    try:
        s0, c0, t0 = proc_cpu(server.proc.pid), time.process_time(), time.perf_counter()
        env = threading.Thread(target=environment, daemon=True)
        env.start()
        got = 0
        with httpx.Client(timeout=600) as http:
            while got < groups and not errors:
                batch = http.get(server.url + "/batch").json()["batch"]
                if batch is None:
                    time.sleep(0.02)
                    continue
                for g in batch:
                    reference_arrays(g)  # the trainer's first step there
                got += len(batch)
        t1 = time.perf_counter()
        env.join()
        if errors:
            raise RuntimeError("reference environment failed") from errors[0]
        return ReferenceRun(got, t1 - t0, time.process_time() - c0, proc_cpu(server.proc.pid) - s0)
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description="serve the reference transport (used by bench.run)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--batch-seqs", type=int, required=True)
    args = p.parse_args()
    import uvicorn

    uvicorn.run(make_app(args.batch_seqs), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
