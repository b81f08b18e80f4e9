#!/usr/bin/env bash
# The GPU decoding paths on a machine with a GPU, in one call, without real weights: the GPU
# tests of tests/it/gpu_decode.rs (flash over the slot cache against dense attention, graph replays
# against eager steps, f32 losslessness), then `eval` and `regenerate` on a random model of the
# target's shape (speed only: a random model's answers mean nothing).
# Inputs in $W: dflash-tui, it (the integration-test binary, from lab/carry-tests.sh), shape/
# (config.json of the target), data/ (a prepare-data folder of that tokenizer). Results in $OUT.
#   W=.carry/check OUT=/tmp/out bash lab/gpu-decode-check.sh
set -uo pipefail
TL=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/lib
export LD_LIBRARY_PATH=$TL
W=${W:-.carry/check}
OUT=${OUT:-/tmp/out}
B=$W/dflash-tui
mkdir -p "$OUT"
t() { echo "== $(date +%T) $*"; }

t doctor; $B doctor 2>&1 | head -12
t gpu-tests
"$W/it" --ignored gpu_decode:: --test-threads 1 2>&1 | tail -15

t random-model
python3 - "$W/shape" /tmp/rand <<'PY'
import sys, torch, transformers
cfg = transformers.AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
model.save_pretrained(sys.argv[2], safe_serialization=True)
print("random", cfg.model_type, sum(p.numel() for p in model.parameters()), "parameters")
PY
cp "$W/shape/config.json" /tmp/rand/config.json
$B init-drafter --target /tmp/rand --out /tmp/rand-drafter --mask-token-id "${MASK:-16}" 2>&1 | tail -1

t eval-graphs
$B eval --target /tmp/rand --drafter /tmp/rand-drafter --data "$W/data" --limit "${PROMPTS:-12}" \
  --max-new-tokens 96 --json > "$OUT/eval-graphs.json" 2> "$OUT/eval-graphs.err"
t eval-eager
$B eval --target /tmp/rand --drafter /tmp/rand-drafter --data "$W/data" --limit "${PROMPTS:-12}" \
  --max-new-tokens 96 --no-cuda-graphs --json > "$OUT/eval-eager.json" 2> "$OUT/eval-eager.err"
t eval-f32
$B eval --target /tmp/rand --drafter /tmp/rand-drafter --data "$W/data" --limit 4 \
  --max-new-tokens 64 --dtype f32 --json > "$OUT/eval-f32.json" 2> "$OUT/eval-f32.err"
python3 tools/eval_summary.py "$OUT"/eval-graphs.json "$OUT"/eval-eager.json "$OUT"/eval-f32.json
tail -3 "$OUT/eval-graphs.err"

t regenerate
$B regenerate --target /tmp/rand --input "$W/data" --out /tmp/regen --max-new-tokens 256 \
  --max-len 2048 --batch-size "${BATCH:-1024}" --limit "${ROWS:-2000}" --max-turns 1 2> "$OUT/regen.err" | tail -8
grep -E "decoding steps|tokens/s" "$OUT/regen.err" | tail -4
t done
