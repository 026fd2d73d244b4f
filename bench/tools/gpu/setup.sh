# Sourced by the scripts beside it, from the repository root on a GPU machine.
# WHEELS (default .whl3): a folder of wheels the machine lacks (pydantic and its needs for the
# server), installed into /tmp/site; the repo goes on the path. The commit comes from
# .gpu-commit (write `git rev-parse --short HEAD > .gpu-commit` here and name it in the call's
# carry: git ignores it, so it travels only when carried; the copy may have no .git, or one
# older than the tree, whose HEAD would mislabel the results). Results go to OUT (default
# bench/results/mixed).
W=${WHEELS:-.whl3}
if ls "$W"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$W"/*.whl >/tmp/whl.log 2>&1 || { cat /tmp/whl.log; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -f .gpu-commit ] && export VERIFYPD_GIT_COMMIT=$(cat .gpu-commit)
C=${VERIFYPD_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-bench/results/mixed}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
