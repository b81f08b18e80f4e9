#!/usr/bin/env bash
# The real SmolLM2 drafter on a GPU machine (issue 7's recipe), in stages so that each fits one
# device call. Inputs in $W: dflash-tui (release binary), gg.00 + gg.01 (the demo GGUF, split),
# sharegpt.jsonl.xz (the demo conversations), whl/ (transformers + dflash wheels, for the
# public-implementation check). Results go to $OUT.
#   W=/tmp/w OUT=/tmp/out bash scripts/gpu-smollm2-real.sh data|train|eval|public
# (eval: 100 held-out prompts x 128 tokens, about 6 minutes on 2 GPUs; public: the drafter in
# z-lab's implementation against dflash-tui on 20 prompts in f32)
set -euo pipefail
TL=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))" 2>/dev/null)/lib || true
export LD_LIBRARY_PATH=$TL
W=${W:-/tmp/w}
OUT=${OUT:-/tmp/out}
B=$W/dflash-tui
GPUS=${GPUS:-cuda:0,cuda:1}
mkdir -p "$OUT"
t() { echo "== $(date +%T) $*"; }

case "$1" in
data)
  t import; cat "$W"/gg.00 "$W"/gg.01 > "$W/smol.gguf"
  $B import-gguf "$W/smol.gguf" "$W/smol" --dtype bf16 2>&1 | tail -2
  t prepare; xz -dc "$W/sharegpt.jsonl.xz" > "$W/sharegpt.jsonl"
  $B prepare-data --tokenizer "$W/smol" --input "$W/sharegpt.jsonl" --out "$W/sg" 2>&1 | tail -4
  t regenerate
  $B regenerate --target "$W/smol" --input "$W/sg" --out "$W/regen" \
    --max-turns 1 --max-new-tokens "${MAX_NEW:-320}" --limit "${LIMIT:-5000}" \
    --batch-size "${BATCH:-384}" --max-len 2048 --device "$GPUS" 2> "$OUT/regenerate.err"
  tail -25 "$OUT/regenerate.err"
  $B inspect-data "$W/regen" 2>&1 | tail -12
  ;;
train)
  t train
  timeout -s INT "${TRAIN_S:-330}" $B train --config configs/gpu-smollm2.toml --no-tui \
    --run-dir "$W/run" --set model.target="$W/smol" --set data.path="$W/regen" \
    --set data.max_len=2048 --set data.max_batch=48 --set train.total_steps="${STEPS:-1200}" \
    --set train.num_anchors=256 --set train.lr="${LR:-1e-3}" --set eval.every_steps="${EVAL_EVERY:-250}" \
    --set eval.prompts=8 --set eval.max_new_tokens=64 --set checkpoint.save_every_steps=400 \
    > "$OUT/train.out" 2>&1 || echo "train exit $?"
  tail -30 "$OUT/train.out"
  cp "$W/run/metrics.jsonl" "$W/run/config.toml" "$OUT/"
  cat "$W/run/best/eval.json" || true
  ;;
eval)
  t eval100
  $B eval --target "$W/smol" --drafter "$W/run/best/drafter" --data "$W/sg" --limit "${PROMPTS:-100}" \
    --max-new-tokens "${EVAL_NEW:-128}" --dtype "${EVAL_DTYPE:-auto}" --device "$GPUS" --json > "$OUT/eval100.json"
  python3 -c "import json;r=json.load(open('$OUT/eval100.json'));print({k:r[k] for k in ['tau','speedup','greedy_s_per_token','dflash_s_per_token','mismatches','accepted_by_slot']}, len(r['prompts']))"
  # the best drafter comes back in pieces under 16 MiB: cat drafter.part.* > model.safetensors
  cp "$W/run/best/eval.json" "$OUT/best-eval.json"; cp "$W/run/best/drafter/config.json" "$OUT/drafter-config.json"
  split -b 13M "$W/run/best/drafter/model.safetensors" "$OUT/drafter.part."
  t done
  ;;
public)
  t public-check
  mkdir -p "$W/site"
  python3 -c "import zipfile,glob; [zipfile.ZipFile(w).extractall('$W/site') for w in glob.glob('$W/whl/*.whl')]"
  $B eval --target "$W/smol" --drafter "$W/run/best/drafter" --data "$W/sg" --limit 20 \
    --max-new-tokens 64 --dtype f32 --device "$GPUS" --json > "$OUT/eval20_f32.json"
  PYTHONPATH="$W/site" python3 scripts/check_public_dflash.py "$W/smol" "$W/run/best/drafter" \
    "$OUT/eval20_f32.json" --dtype f32 --max-new-tokens 64 > "$OUT/public.json" 2> "$OUT/public.err" \
    || { echo "public check exit $?"; tail -20 "$OUT/public.err"; }
  cat "$OUT/public.json"
  t done
  ;;
esac
