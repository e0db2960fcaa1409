"""``pip install distillq`` with no extras, in a fresh venv, as a new user does: ``import distillq`` loads only the
exceptions and the wire messages; every public name outside ``distillq.NEEDS_EXTRA`` resolves; each name of it fails
on first use with one line naming its extra; the CLI answers ``--help``."""

from __future__ import annotations

import json
import subprocess
import venv
from pathlib import Path

import pytest

import distillq

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
import distillq
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("pipeline", "schemas"))
names = {}
for name in distillq.__all__:
    try:
        names[name] = ["ok", type(getattr(distillq, name)).__name__]
    except ImportError as e:
        names[name] = ["ImportError", str(e)]
try:
    from distillq import topk_forward_kl  # noqa: F401
    from_import = "ok"
except ImportError as e:
    from_import = str(e)
print(json.dumps({"loaded": loaded, "names": names, "from_import": from_import, "torch": "torch" in sys.modules}))
"""


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no system site-packages) holding distillq installed from this tree without extras."""
    env_dir = tmp_path_factory.mktemp("bare") / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
                           str(ROOT / "constraints.txt"), str(ROOT)], capture_output=True, text=True, timeout=240,
                          check=False)
    if proc.returncode != 0:
        pytest.skip(f"pip could not install distillq into a fresh venv here: {proc.stderr.strip()[-400:]}")
    return py


def test_import_distillq_on_a_bare_install(bare: Path) -> None:
    proc = subprocess.run([str(bare), "-c", PROBE], capture_output=True, text=True, timeout=120, check=False,
                          cwd="/")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    after_import = set(got["loaded"])
    assert after_import <= {"pipeline", "pipeline.errors"} | {m for m in after_import if m.split(".")[0] == "schemas"}
    assert not got["torch"]
    names = got["names"]
    assert sorted(names) == sorted(distillq.__all__)
    failing = {n: v[1] for n, v in names.items() if v[0] != "ok"}
    assert sorted(failing) == sorted(distillq.NEEDS_EXTRA), failing  # all else resolves with no extra
    for name, message in failing.items():
        extra = distillq.NEEDS_EXTRA[name]
        assert message.startswith(f"distillq.{name} needs the '{extra}' extra (") and "\n" not in message, message
        assert message.endswith(f"pip install 'distillq[{extra}]'"), message
    assert got["from_import"].startswith("distillq.topk_forward_kl needs the 'hf' extra")


def test_the_cli_answers_on_a_bare_install(bare: Path) -> None:
    cli = bare.parent / "distillq"
    proc = subprocess.run([str(cli), "--help"], capture_output=True, text=True, timeout=120, check=False, cwd="/")
    assert proc.returncode == 0 and "enqueue" in proc.stdout, proc.stderr
