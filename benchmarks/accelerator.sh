#!/usr/bin/env bash
# The accelerator benchmark as a GPU or TPU owner runs it, from any directory:
#
#   bash benchmarks/accelerator.sh                      # 1b, adamw/kron/shampoo/muon, fp32 + bf16
#   bash benchmarks/accelerator.sh --optimizers adamw   # any flag of benchmarks/accelerator.py
#   BENCH_SECONDS=300 SIZES=tiny STEPS=5 bash benchmarks/accelerator.sh
#
# Where jax is installed already (an accelerator image, often newer than the project's pin),
# the project is installed beside it with `pip install --no-deps -e .`, leaving that jax as it
# is; without jax, `pip install -e .` installs the pinned CPU jax (install jax for your
# accelerator first). Prints the jax version and the devices, then the benchmark's table, a
# row as soon as it is measured (the quickest to compile first), stopped after BENCH_SECONDS
# (default 540) in all: rows measured by then are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

if "$PYTHON" -c "import jax" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet --no-deps -e .
else
  "$PYTHON" -m pip install --quiet -e .
fi
missing=$("$PYTHON" - <<'PY'
import importlib.util
needed = ("jax", "flax", "optax", "ml_collections", "absl", "regex", "orbax.checkpoint")
print(" ".join(m for m in needed if importlib.util.find_spec(m.split(".")[0]) is None))
PY
)
if [ -n "$missing" ]; then
  echo "missing packages: $missing (pip install them, or pip install -e . for the pinned set)" >&2
  exit 1
fi
"$PYTHON" -c "import jax; d = jax.devices(); print('jax', jax.__version__, len(d), d[0].device_kind)"
exec timeout --signal=INT --kill-after=20 "${BENCH_SECONDS:-540}" \
  "$PYTHON" -m benchmarks.accelerator --sizes "${SIZES:-1b}" --steps "${STEPS:-10}" \
  --optimizers "${OPTIMIZERS:-adamw,muon,kron,shampoo}" "$@"
