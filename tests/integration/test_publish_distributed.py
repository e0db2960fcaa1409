"""publish_weights on 2 ranks (gloo, CPU): DDP writes rank 0's replica, FSDP2 (fully_shard) gathers the full
state dict once; one folder, written by rank 0, equal to the unsharded model; the other rank returns None."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.models.weights import LATEST, load_causal_lm, load_weights


def _rank(rank: int, directory: str, mode: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from pipeline.learner.publish import publish_weights

    model = load_causal_lm(ensure_tiny_models().student)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    announced: list[int] = []
    path = publish_weights(model, 4, directory, publish=announced.append)
    assert (path is not None) == (rank == 0) and announced == ([4] if rank == 0 else [])
    assert Path(directory, LATEST).exists()  # every rank returns after the write (barrier)
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks, each loading torch and the student: minutes on 2 cores
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_one_writer(mode: str, tmp_path: Path) -> None:
    from tests.redis_server import free_port

    ensure_tiny_models()
    mp.spawn(_rank, args=(str(tmp_path), mode, free_port()), nprocs=2)
    reference = load_causal_lm(ensure_tiny_models().student)
    loaded = load_causal_lm(ensure_tiny_models().student)
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()
    assert load_weights(loaded, tmp_path) == 4
    for (name, a), b in zip(reference.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
