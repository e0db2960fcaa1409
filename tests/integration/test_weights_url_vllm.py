"""A vLLM student server (CPU build, .venv-vllm; skipped without it) following weights published to
``redis://``: the learner publishes with ``publish_weights`` to a database of a real redis-server, a ``Follower``
mirrors the store into a local folder, ``SyncedStudent`` reloads the server from it; after each version the
server names it and its prompt logprobs equal a transformers forward of the published weights (a snapshot, then
deltas). A version with a corrupt chunk and one with a missing chunk are refused by name and never loaded: the
server keeps the version it has."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.publish import publish_weights
from pipeline.models.weights import CheckpointError
from pipeline.weightstore.follow import Follower
from pipeline.weightstore.stores import RedisStore
from tests.integration.test_weight_sync_vllm import (
    PROMPT,
    TOL,
    perturbed,
    prompt_logprobs,
    reference_logprobs,
    server,  # noqa: F401 - the module's vLLM server fixture
    synced_student,
    weight_version,
)
from tests.integration.test_weights_url_loop import CORRUPT, TORN, plant
from tests.vllm_server import START_TIMEOUT_S, needs_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(3 * START_TIMEOUT_S),
              needs_vllm]


async def test_vllm_server_follows_a_redis_url(server: str, redis_url: str, tmp_path: Path) -> None:  # noqa: F811
    url = redis_url.rsplit("/", 1)[0] + "/1?prefix=vllm-w&snapshot_every=10"
    refused: list[CheckpointError] = []
    follower = Follower(url, tmp_path / "mirror", on_refused=refused.append)
    student = synced_student(server, follower.local_dir)
    try:
        await student.start()
        for version in (1, 2, 3):  # a snapshot, then two deltas
            model = perturbed(version)
            publish_weights(model, version, url, publish=lambda v: None, tokenizer_dir=ensure_tiny_models().student)
            assert await follower.sync() == version
            await student.sync_once()
            assert weight_version(server) == str(version)
            np.testing.assert_allclose(prompt_logprobs(server, PROMPT), reference_logprobs(model, PROMPT), atol=TOL,
                                       rtol=0)
        good = prompt_logprobs(server, PROMPT)
        store = RedisStore(url)
        for bad, fault, kind in ((CORRUPT, "corrupt", "corrupt"), (TORN, "torn", "incomplete")):
            plant(store, bad, fault)
            assert await follower.sync() == 3
            await student.sync_once()
            assert refused[-1].version == bad and refused[-1].kind == kind
            assert weight_version(server) == "3" and student.states[0].usable()
            np.testing.assert_array_equal(prompt_logprobs(server, PROMPT), good)
    finally:
        await student.aclose()
        follower.mirror.store.close()
