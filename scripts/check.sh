#!/usr/bin/env bash
# The fast checks, seconds in all, run before any test (.ci/run runs them first; run them before a commit):
#   ruff          pyproject.toml [tool.ruff]: unused and undefined names, pycodestyle's classes about meaning
#   lint-imports  pyproject.toml [tool.importlinter]: the layers and the three forbidden imports
#   mypy          pyproject.toml [tool.mypy]: the types of the packages it names
# each as tests/unit/test_layers.py runs it (which also shows each one failing on a planted error). The first
# that fails stops the script with its exit status.
#
#   scripts/check.sh            with the tools of the active environment (or ./.venv), which the test extra installs
#   scripts/check.sh --install  first installs only these three tools into the active environment, at the test
#                               extra's specifiers: what .ci/run does in a fresh .venv before the full install. With
#                               no third-party package installed, mypy takes them as Any (ignore_missing_imports);
#                               test_layers checks again, with them, in the test run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --install ]; then
  # the three specifiers as pyproject.toml's test extra writes them, e.g. "ruff>=0.6"
  mapfile -t tools < <(grep -oE '^ *"(ruff|mypy|import-linter)[<>=!~ 0-9.,]*"' pyproject.toml | tr -d ' "')
  [ ${#tools[@]} -eq 3 ] || { echo "check: expected ruff, mypy and import-linter in pyproject.toml's test extra, found: ${tools[*]}" >&2; exit 2; }
  python -m pip install -q -c constraints.txt "${tools[@]}"
fi

tool() {
  if command -v "$1" >/dev/null; then echo "$1"
  elif [ -x .venv/bin/"$1" ]; then echo .venv/bin/"$1"
  else echo "check: $1 is not installed: pip install -c constraints.txt -e '.[test]' (or scripts/check.sh --install)" >&2; return 1
  fi
}

run() {
  local name=$1 start=$EPOCHREALTIME
  shift
  if "$@"; then
    awk -v name="$name" -v s="$start" -v e="$EPOCHREALTIME" 'BEGIN { printf "check: %s passed (%.1f s)\n", name, e - s }'
  else
    local rc=$?
    echo "check: $name FAILED (exit $rc)" >&2
    exit "$rc"
  fi
}

ruff=$(tool ruff); lint_imports=$(tool lint-imports); mypy=$(tool mypy)
run ruff "$ruff" check --no-cache .
run lint-imports "$lint_imports" --no-cache   # reads pyproject.toml in this directory
run mypy "$mypy" --config-file pyproject.toml
