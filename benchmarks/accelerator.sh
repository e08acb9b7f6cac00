#!/usr/bin/env bash
# The accelerator benchmark as a GPU or TPU owner runs it, from any directory. On one TPU v5e:
#
#   bash benchmarks/accelerator.sh --seq_len 2048 --batch_size 16     # 125m, 5 optimizers, bf16
#   SIZES=1b DTYPES=all-bfloat16 bash benchmarks/accelerator.sh --grad_accum_steps 16
#   OPTIMIZERS=adamw WINDOWS=1 bash benchmarks/accelerator.sh        # any flag: see --help
#
# SIZES (125m), OPTIMIZERS (adamw,muon,kron,shampoo,soap), DTYPES (bfloat16) and WINDOWS (3)
# choose the rows; the arguments go to `python -m benchmarks.accelerator` as they are.
# PYTHON picks the interpreter. The jax already installed is used as it is: the project is
# installed beside it with `pip install --no-deps -e .`; where pip cannot (no registry), the
# checkout goes on PYTHONPATH instead. Only without any jax does `pip install -e .` install
# the pinned CPU jax (install jax for your accelerator first). Prints the jax version and
# the devices, then the table, a row as soon as it is measured. Everything stops after
# BENCH_SECONDS (default and most 540): rows measured by then are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
LIMIT=540
DEVICES="import jax; d = jax.devices(); print('jax', jax.__version__, len(d), d[0].device_kind)"
seconds="${BENCH_SECONDS:-$LIMIT}"
if [ "$seconds" -gt "$LIMIT" ]; then
  echo "BENCH_SECONDS=$seconds lowered to $LIMIT: one call ends within 9 minutes"
  seconds=$LIMIT
fi

if "$PYTHON" -c "import jax" 2>/dev/null; then
  "$PYTHON" -c "$DEVICES"
  if ! "$PYTHON" -m pip install --quiet --no-deps --retries 0 --timeout 10 -e . >/dev/null 2>&1
  then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "pip install --no-deps -e . failed: running from the checkout (PYTHONPATH=$PWD)"
  fi
else
  "$PYTHON" -m pip install --quiet -e .
  "$PYTHON" -c "$DEVICES"
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
left=$((seconds - SECONDS))
exec timeout --signal=INT --kill-after=10 "$((left > 1 ? left : 1))" \
  "$PYTHON" -m benchmarks.accelerator --sizes "${SIZES:-125m}" --windows "${WINDOWS:-3}" \
  --optimizers "${OPTIMIZERS:-adamw,muon,kron,shampoo,soap}" --dtypes "${DTYPES:-bfloat16}" "$@"
