#!/usr/bin/env bash
# Dependency runs, each in a fresh venv of its own (.venv-deps-MODE), never in the caller's environment:
#   bash ops/deps.sh lock          refresh the lock: the newest versions pyproject.toml allows, the whole suite,
#                                  and constraints.txt rewritten only if the suite passed
#   bash ops/deps.sh lock --keep   the same, keeping the locked versions and resolving only what the lock lacks
#                                  (after adding a dependency)
#   bash ops/deps.sh newest        the suite against the newest allowed versions: a report, exit 0 (CI runs it)
#   bash ops/deps.sh floor         the suite against the lowest allowed versions of the fast-moving dependencies
#                                  (transformers, tokenizers, numpy, atroposlib, verifiers): a report, exit 0 (CI)
# In newest and floor runs a third-party deprecation is reported, not failed; distillq's own warnings, and the
# tests in tests/unit/test_third_party_apis.py (one per third-party API distillq relies on), still fail on one.
# DISTILLQ_DEPS_DEADLINE: epoch seconds by which the tests stop (CI's time budget).
# DISTILLQ_DEPS_TESTS: pytest arguments as shell words (default: the whole suite), e.g. "-m 'not vllm'".
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
keep=${2:-}
case "$mode" in lock|newest|floor) ;; *) sed -n '2,13p' "$0" >&2; exit 2 ;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
venv=".venv-deps-$mode"
extras=$(python3 -c "import tomllib; print(','.join(tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']))")
rm -rf "$venv" && python3 -m venv "$venv" || exit 1
pip=("$venv/bin/python" -m pip install)
case "$mode" in
  lock) [ "$keep" = "--keep" ] && pip+=(-c constraints.txt) ;;
  floor) "$venv/bin/python" ops/deps.py floor > "$venv/floor.txt" && pip+=(-c "$venv/floor.txt")
         echo "floor pins: $(tr '\n' ' ' < "$venv/floor.txt")" ;;
esac
if ! "${pip[@]}" -e ".[$extras]" > "$venv/install.log" 2>&1; then
  echo "deps $mode: the install failed (the allowed ranges cannot be installed together):"
  grep -vE "^(WARNING: Location|Requirement already|  )" "$venv/install.log" | grep -A12 -E "conflict|ERROR" | head -30
  [ "$mode" = lock ] && exit 1 || exit 0
fi
echo "deps $mode: versions that differ from constraints.txt"
"$venv/bin/python" ops/deps.py diff constraints.txt
[ "$mode" = lock ] || export DISTILLQ_THIRD_PARTY_WARNINGS=report
eval "set -- ${DISTILLQ_DEPS_TESTS:-}"  # shell words: -m 'not vllm' stays one argument
# DISTILLQ_DEPS_DEADLINE (epoch seconds): pytest is interrupted then, and still prints what failed so far.
limit=$(( ${DISTILLQ_DEPS_DEADLINE:-$(( $(date +%s) + 86400 ))} - $(date +%s) ))
[ "$limit" -gt 0 ] || { echo "deps $mode: no time left for the tests"; exit 0; }
PATH="$PWD/$venv/bin:$PATH" timeout -s INT -k 60 "$limit" "$venv/bin/python" -m pytest -p no:cacheprovider -q -rfE \
  "$@" > "$venv/pytest.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR) |passed|failed" "$venv/pytest.log" | tail -40
if [ "$mode" = lock ]; then
  if [ $rc -eq 0 ]; then
    "$venv/bin/python" ops/deps.py freeze constraints.txt
    git --no-pager diff --stat constraints.txt || true
  else
    echo "deps lock: the suite failed on these versions (log: $venv/pytest.log); constraints.txt kept as it was"
  fi
  exit $rc
fi
echo "deps $mode: pytest exit status $rc (reported only; log: $venv/pytest.log)"
echo "deps $mode: third-party deprecations seen:"
grep -hoE "[A-Za-z_]*(Deprecation|Future)Warning: .{0,160}" "$venv/pytest.log" | sort | uniq -c | sort -rn | head -15
exit 0
