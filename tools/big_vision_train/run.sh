#!/usr/bin/env bash
# big_vision's own train.py with the plugin: trains, checkpoints, resumes on fewer devices.
#
#   tools/big_vision_train/run.sh BIG_VISION_DIR OUT_DIR [adam kron shampoo muon soap kron_scan ...]
#
# BIG_VISION_DIR is a checkout of https://github.com/google-research/big_vision (measured at
# commit 0127fb6; the folder holding the `big_vision` package). The script edits it, once:
# train.py's two imports `big_vision.optax` / `big_vision.sharding` become the plugin's
# `bv_sharding.big_vision.optax` / `.sharding`, and `utils.sync` builds a NamedSharding
# where it used jax.sharding.PositionalSharding (removed in jax 0.10). Nothing else changes.
#
# Python: $PYTHON (default `python`), a venv with this checkout (`pip install -e .`) and
# tensorflow-cpu, clu, tensorflow-datasets, einops, overrides, psutil, sentencepiece.
#
# Per optimizer (default: the first five; kron_scan and shampoo_scan are Kron and Shampoo on
# the ViT with scanned blocks, config.scanned_layers naming them): 20 steps on 8 simulated CPU devices (big_vision saves
# its checkpoint at step 20, OUT_DIR/<opt>/d8), the workdir copied to d4 and d2, each resumed
# by big_vision itself on 4 and 2 devices with --config.total_steps=40. Logs are
# OUT_DIR/<opt>/d<N>.log; the loss table is printed at the end (table.py) and in
# OUT_DIR/table.md. The config is tiny_vit.py, the data make_data.py (both beside this file).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,/^set /p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
fi
BV=$(cd "$1" && pwd)
mkdir -p "$2"
OUT=$(cd "$2" && pwd)
shift 2
NAMES=("$@")
[[ ${#NAMES[@]} -gt 0 ]] || NAMES=(adam kron shampoo muon soap)
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python}

# The two edits, applied where not applied yet; any other state of the files stops the run.
"$PY" - "$BV" <<'PYEOF'
import pathlib
import sys

root = pathlib.Path(sys.argv[1]) / "big_vision"
edits = {
    "train.py": [
        ("import big_vision.optax as bv_optax\n",
         "from bv_sharding.big_vision import optax as bv_optax\n"),
        ("import big_vision.sharding as bv_sharding\n",
         "from bv_sharding.big_vision import sharding as bv_sharding\n"),
    ],
    "utils.py": [
        ("              jax.sharding.PositionalSharding(jax.devices()))\n",
         "              jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices(), (\"d\",)),\n"
         "                                         jax.sharding.PartitionSpec(\"d\")))\n"),
    ],
}
for name, pairs in edits.items():
  path = root / name
  text = path.read_text()
  for old, new in pairs:
    if new in text:
      continue
    if text.count(old) != 1:
      sys.exit(f"{path}: neither the original nor the edited line found: {old.strip()}")
    text = text.replace(old, new)
    print(f"edited {path}: {old.strip()} -> {new.strip()}")
  path.write_text(text)
PYEOF

"$PY" "$HERE/make_data.py" "$OUT/data" >/dev/null

# The library's defaults but blocks of 32 and, for Kron and SOAP, resident_padding=0: a pool's
# state kept where it runs has the device count in its shapes, which big_vision's loader cannot
# resume on 4 and 2 devices. lr: AdamW's 0.003 for every one (SOAP's times its LR_SCALE, 2).
declare -A ARG=(
  [adam]="scale_by_adam"
  [kron]="bv_sharding.scale_by_kron,block_size=32,resident_padding=0"
  [shampoo]="bv_sharding.scale_by_shampoo,block_size=32"
  [muon]="bv_sharding.scale_by_muon"
  [soap]="bv_sharding.scale_by_soap,block_size=32,resident_padding=0"
  [kron_scan]="bv_sharding.scale_by_kron,block_size=32,resident_padding=0,scan=True"
  [shampoo_scan]="bv_sharding.scale_by_shampoo,block_size=32,scan=True"
)
declare -A LR=([adam]=0.003 [kron]=0.003 [shampoo]=0.003 [muon]=0.003 [soap]=0.006 [kron_scan]=0.003
  [shampoo_scan]=0.003)

train() {  # train NAME DEVICES TOTAL_STEPS
  local name=$1 devices=$2 steps=$3
  echo "$name on $devices devices to step $steps: $OUT/$name/d$devices.log"
  XLA_FLAGS="--xla_force_host_platform_device_count=$devices --xla_backend_optimization_level=0" \
    PYTHONPATH="$BV${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m big_vision.train \
    --config "$HERE/tiny_vit.py:${ARG[$name]}" --config.lr="${LR[$name]}" \
    --config.input.data.fname="$OUT/data/train.jsonl" \
    --config.total_steps="$steps" --workdir "$OUT/$name/d$devices" \
    >"$OUT/$name/d$devices.log" 2>&1
}

for name in "${NAMES[@]}"; do
  [[ -n ${ARG[$name]:-} ]] || { echo "unknown optimizer $name (adam kron shampoo muon soap kron_scan shampoo_scan)"; exit 2; }
  rm -rf "${OUT:?}/$name"
  mkdir -p "$OUT/$name"
  train "$name" 8 20
  cp -r "$OUT/$name/d8" "$OUT/$name/d4"
  cp -r "$OUT/$name/d8" "$OUT/$name/d2"
  train "$name" 4 40
  train "$name" 2 40
done

"$PY" "$HERE/table.py" "$OUT" "${NAMES[@]}" | tee "$OUT/table.md"
