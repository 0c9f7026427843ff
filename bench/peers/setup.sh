#!/usr/bin/env bash
# Separate virtual environments for the peer frameworks, under bench/.venvs/ (git-ignored, never project
# dependencies): Flower's simulation engine (flwr[simulation], with Ray) and pfl-research (pfl[pytorch]).
# torch is pinned to the project's version first, so the peers run the same kernels as fedpilot.
# Usage: bench/peers/setup.sh [flower] [pfl]   (both by default; an environment already set up is kept)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}

make_env() {
  local name=$1 requirement=$2 env=.venvs/$1
  if [ -f "$env/.installed" ]; then return; fi
  echo "setting up $env ($requirement, $TORCH)" >&2
  rm -rf "$env"
  "$PYTHON" -m venv "$env"
  "$env/bin/pip" install --quiet --upgrade pip
  "$env/bin/pip" install --quiet "$TORCH"
  "$env/bin/pip" install --quiet "$requirement" "$TORCH"
  touch "$env/.installed"
}

for peer in "${@:-flower pfl}"; do
  for name in $peer; do
    case $name in
      flower) make_env flower "flwr[simulation]" ;;
      pfl) make_env pfl "pfl[pytorch]" ;;
      *) echo "unknown peer '$name' (flower, pfl)" >&2; exit 2 ;;
    esac
  done
done
