"""Weight sync for local (transformers) students: the learner publishes, rollout workers reload.

The learner writes ``DIR/policy.safetensors`` (atomic rename; safetensors, never pickle) and only
then sets the policy version in Redis, so a worker that sees version v finds weights at least as new
as v. A worker tags every group with the version of the weights it actually sampled with.

Weights go through safetensors' ``save_model``/``load_model``, which store a tensor shared by two names once
(tied input embeddings and lm_head, as in SmolLM2) and restore the tie on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "policy.safetensors"
META_FILE = "policy.json"


def save_weights(model: Any, directory: str | Path, version: int) -> Path:
    """Atomically write ``model``'s weights and their version to ``directory``."""
    from safetensors.torch import save_model

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
    save_model(model, str(tmp), metadata={"version": str(version)})
    os.replace(tmp, d / WEIGHTS_FILE)
    meta_tmp = d / f".{META_FILE}.tmp"
    meta_tmp.write_text(json.dumps({"version": version}))
    os.replace(meta_tmp, d / META_FILE)
    return d / WEIGHTS_FILE


def load_weights(model: Any, directory: str | Path) -> int | None:
    """Load the published weights into ``model``; returns their version (``None`` if none yet)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    path = Path(directory) / WEIGHTS_FILE
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        version = int((f.metadata() or {}).get("version", "0"))
    load_model(model, str(path), strict=True)
    return version
