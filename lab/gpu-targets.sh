#!/usr/bin/env bash
# The GPU acceptance runs of the Qwen3.5 hybrid and mixture-of-experts targets, in stages that
# each fit one device call. Carried in .carry/ (made by `lab/gpu-targets.sh pack` here):
# anchors/ (copies of ../shared/anchors), bins.tar.xz (the stripped release binary, the library's and the integration tests' (it) test binaries),
# benchdata.tar.xz (assets/bench), whl/ (FLA 0.6.0 for the anchors), debs/ (tmux), mt-bench.jsonl.
# Every stage unpacks them into $W once, so a stage runs on a fresh machine as on a warm one.
#   OUT=/tmp/out bash lab/gpu-targets.sh check|anchors|bench|ab|room
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = pack ]; then
  set -e
  make carry >/dev/null
  bash lab/carry-tests.sh >/dev/null
  tar -C .carry -cf - dflash-tui tests | xz -T2 -6 > .carry/bins.tar.xz
  rm -rf .carry/dflash-tui .carry/tests
  tar -C assets -cf - bench | xz -T2 -6 > .carry/benchdata.tar.xz
  mkdir -p .carry/whl .carry/debs
  (cd .carry/whl && python3 -m pip download -q --no-deps -d . flash-linear-attention==0.6.0 fla-core==0.6.0)
  (cd .carry/debs && apt-get download -q tmux libevent-core-2.1-7 libutempter0 2>/dev/null)
  cp assets/demo/mt-bench.jsonl .carry/ && mkdir -p .carry/anchors && cp ../shared/anchors/*.py .carry/anchors/
  du -sh .carry/*
  exit 0
fi
TL=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")/lib
export LD_LIBRARY_PATH=$TL
W=${W:-/tmp/w}
OUT=${OUT:-/tmp/out}
B=$W/dflash-tui
mkdir -p "$OUT" "$W"
t() { echo "== $(date +%T) $*"; }
if [ ! -x "$B" ]; then
  xz -dc .carry/bins.tar.xz | tar -C "$W" -xf -
  xz -dc .carry/benchdata.tar.xz | tar -C "$W" -xf -
fi
mkdir -p assets
ln -sfn "$W/bench" assets/bench
# one JSON line of a command's stdout into $OUT/NAME.json, its log into NAME.err
run_json() { # NAME TIMEOUT command...
  local name=$1 limit=$2; shift 2
  t "$name"
  timeout "$limit" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  local rc=$?
  [ $rc -ne 0 ] && { echo "$name: exit $rc"; tail -4 "$OUT/$name.err"; }
  cat "$OUT/$name.json"
}

case "${1:-}" in
check)
  nvidia-smi -L
  $B doctor 2>&1 | sed -n 2,6p
  t gdn-kernel-tests
  timeout 150 "$W/tests/lib" --ignored aten_ext::gdn:: cuda_blocks --test-threads 1 2>&1 | tail -14
  run_json gdn-48x48 120 $B bench-gdn --reference
  run_json gdn-48x16 60 $B bench-gdn --key-heads 16
  run_json forward-qwen3.5-27b 150 $B bench-forward --target configs/shapes/qwen3.5-27b --random-weights
  run_json forward-qwen3.5-35b-a3b 120 $B bench-forward --target configs/shapes/qwen3.5-35b-a3b --random-weights
  run_json forward-qwen3-30b-a3b 120 $B bench-forward --target configs/shapes/qwen3-30b-a3b --random-weights
  ;;
anchors)
  python3 -m pip install -q --no-deps --target /tmp/fla .carry/whl/*.whl 2>&1 | tail -2
  t gpu-decode-tests
  timeout 200 "$W/tests/it" --ignored gpu_decode:: --test-threads 1 2>&1 | tail -16
  run_json anchor-qwen3.5-27b 240 env PYTHONPATH=/tmp/fla python3 .carry/anchors/qwen35_hf_forward.py 1 3072 64
  run_json anchor-qwen3.5-35b-a3b 180 env PYTHONPATH=/tmp/fla python3 .carry/anchors/qwen35_moe_hf_forward.py 1 3072
  ;;
bench)
  for p in ${PROFILES:-qwen3.5-27b-shape qwen3.5-35b-a3b-shape qwen3-8b-shape}; do
    run_json "bench-$p" "${BENCH_S:-270}" $B bench --profile "$p" --warmup-steps 3 --steps "${STEPS:-10}" \
      --trace "/tmp/trace-$p.json"
    python3 -c "import json,sys;r=json.load(open(sys.argv[1]));print('drafter_step_ms', r.get('drafter_step_ms'))" "$OUT/bench-$p.json"
    [ -f "/tmp/trace-$p.json" ] && python3 tools/trace_summary.py "/tmp/trace-$p.json" > "$OUT/trace-$p.txt" 2>&1 && head -40 "$OUT/trace-$p.txt"
  done
  ;;
ab)
  # The binary against other ones (VARIANTS, default "base": .carry/dflash-tui-NAME.xz, xz of
  # stripped release binaries), alternating on this machine, after the GPU tests of the
  # drafter's fused training path: PROFILE (qwen3-8b-shape), ROUNDS rounds (2), STEPS (20). One
  # row per run. TESTS=0 skips the tests (a second A/B on the same machine).
  # a variant "set:KEY=VALUE" is this binary with `--set KEY=VALUE`
  for v in ${VARIANTS:-base}; do
    case "$v" in set:*) continue ;; esac
    [ -x "$W/$v" ] || { xz -dc ".carry/dflash-tui-$v.xz" > "$W/$v" && chmod +x "$W/$v"; }
  done
  nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
  if [ "${TESTS:-1}" = 1 ]; then
    t gpu-tests
    timeout 240 "$W/tests/it" --ignored gpu_drafter_training_with_fused gpu_decode::fused \
      --test-threads 1 2>&1 | grep -E "^test |test result"
  fi
  for i in $(seq "${ROUNDS:-2}"); do
    for which in new ${VARIANTS:-base}; do
      bin=$B; extra=(); name=$which
      case "$which" in
        new) ;;
        set:*) extra=(--set "${which#set:}"); name=${which#set:}; name=${name//[^A-Za-z0-9._-]/_} ;;
        *) bin=$W/$which ;;
      esac
      run_json "ab-$name-$i" "${BENCH_S:-200}" "$bin" bench --profile "${PROFILE:-qwen3-8b-shape}" \
        --warmup-steps 3 --steps "${STEPS:-20}" "${extra[@]}" > /dev/null
      python3 - "$OUT/ab-$name-$i.json" "$which" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(print(sys.argv[2], "no result"))
d = r.get("drafter_step_ms") or {}
ms = " / ".join(f"{d.get(k, 0):.1f}" for k in ["forward", "loss", "backward", "optimizer", "total"])
print(f"{sys.argv[2]}: {r['samples_per_s']:.3f} samples/s, MFU {r['mfu']:.3f}, efficiency "
      f"{r['pipeline_efficiency']:.3f}, drafter {ms} ms, alone {r.get('stage_alone_tokens_per_s')}")
PY
    done
  done
  ;;
room)
  # a small Qwen3.5 model written by the machine's transformers, with the Qwen3 tokenizer
  t target
  python3 - <<'PY'
import shutil, torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
cfg = Qwen3_5TextConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=8192,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
torch.manual_seed(0)
m = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
m.save_pretrained("/tmp/q35t", safe_serialization=True)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"assets/bench/qwen3-tokenizer/{f}", f"/tmp/q35t/{f}")
print("qwen3.5 target:", sum(p.numel() for p in m.parameters()) / 1e6, "M parameters")
PY
  $B doctor --model /tmp/q35t 2>&1 | tail -1
  t regenerate
  timeout 150 $B regenerate --target /tmp/q35t --input assets/bench/sharegpt-qwen3-3000 --out /tmp/q35regen \
    --max-new-tokens 256 --max-len 1024 --limit "${ROWS:-1500}" --max-turns 1 2> "$OUT/regen.err" | tail -3
  grep -E "tokens/s|rows" "$OUT/regen.err" | tail -3
  # the control room, in tmux
  if ! command -v tmux >/dev/null; then
    for d in .carry/debs/*.deb; do dpkg-deb -x "$d" "$W/tmuxroot"; done
    export PATH="$W/tmuxroot/usr/bin:$PATH"
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$W/tmuxroot/usr/lib/x86_64-linux-gnu"
  fi
  R=/tmp/q35run
  sets="--set model.target=/tmp/q35t --set model.random_weights=false --set model.drafter_layers=2"
  sets="$sets --set model.mask_token_id=${MASK:-151648} --set data.path=/tmp/q35regen --set data.max_len=1280"
  sets="$sets --set data.token_budget=8192 --set data.max_batch=16 --set train.num_anchors=128"
  sets="$sets --set train.total_steps=${STEPS:-600} --set train.lr=1e-3 --set checkpoint.save_every_steps=200"
  sets="$sets --set telemetry.log_every_steps=10 --set telemetry.profile_interval_s=10"
  t train
  tmux new-session -d -s cr -x 150 -y 48 "$B train --config configs/bench-qwen3.5-4b-shape.toml $sets --run-dir $R 2> $OUT/train.err"
  for i in $(seq 1 60); do [ -S $R/control.sock ] && break; sleep 1; done
  sleep "${SCREEN_AFTER_S:-45}"
  tmux capture-pane -p -t cr > "$OUT/control-room.txt"
  $B ctl $R status > "$OUT/ctl-status.json" 2>&1
  $B ctl $R checkpoint > "$OUT/ctl-checkpoint.txt" 2>&1
  cat "$OUT/control-room.txt"; head -c 1500 "$OUT/ctl-status.json"; echo
  for i in $(seq 1 "${TRAIN_WAIT_S:-240}"); do tmux has-session -t cr 2>/dev/null || break; sleep 1; done
  tmux kill-session -t cr 2>/dev/null
  tail -3 "$OUT/train.err"
  D=$(ls -d $R/checkpoints/step-*/drafter | tail -1)
  echo "drafter: $D"
  run_json eval-mtbench-graphs 120 $B eval --target /tmp/q35t --drafter "$D" --prompts .carry/mt-bench.jsonl --limit 40 --max-new-tokens 128 --json
  run_json eval-mtbench-f32 120 $B eval --target /tmp/q35t --drafter "$D" --prompts .carry/mt-bench.jsonl --limit 12 --max-new-tokens 96 --dtype f32 --json
  python3 tools/eval_summary.py "$OUT"/eval-mtbench-graphs.json "$OUT"/eval-mtbench-f32.json 2>&1 | tail -8
  ;;
gdn)
  # the gated delta rule kernels (the chunked form on tensor cores and in float32, the causal
  # convolution) and the fused kernels: tests, then every form at the 27B and 35B-A3B layer shapes
  t gdn-kernel-tests
  timeout 200 "$W/tests/lib" --ignored aten_ext::gdn:: aten_ext::fused --test-threads 1 2>&1 | tail -24
  t hybrid-decode-tests
  timeout 150 "$W/tests/it" --ignored gpu_decode::gpu_hybrid gpu_decode::fused_norms --test-threads 1 2>&1 | tail -12
  run_json gdn-27b 90 $B bench-gdn --key-heads 16 --reference
  run_json gdn-35b-a3b 60 $B bench-gdn --key-heads 16 --value-heads 32
  ;;
probe)
  # where the target forwards' time goes, with the gated delta rule's prefill in each form: one
  # traced call each, totalled by kernel
  for shape in ${SHAPES:-qwen3.5-27b qwen3.5-35b-a3b}; do
    for form in ${FORMS:-recurrent chunked chunked-float32}; do
      run_json "forward-$shape-$form" 150 $B bench-forward --target "configs/shapes/$shape" \
        --random-weights --iters 2 --gdn-prefill "$form" --trace "/tmp/forward-$shape-$form.trace.json"
      python3 tools/trace_summary.py "/tmp/forward-$shape-$form.trace.json" \
        > "$OUT/trace-forward-$shape-$form.txt" 2>&1
      head -24 "$OUT/trace-forward-$shape-$form.txt"
    done
  done
  ;;
dist1)
  # issue 45: the same 8B-shape training through the c10d path with one rank (WORLD_SIZE=1)
  # and through the plain path; samples/s over the steps after the first 10, from metrics.jsonl
  for mode in plain c10d; do
    t "train-8b-$mode"
    env=""
    [ $mode = c10d ] && env="WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517"
    env $env timeout "${DIST_S:-150}" $B train --config configs/bench-qwen3-8b-shape.toml --no-tui \
      --set train.total_steps="${STEPS:-50}" --run-dir "/tmp/dist1-$mode" > "$OUT/train-8b-$mode.out" 2> "$OUT/train-8b-$mode.err"
    grep -E "grad|c10d|rank" "$OUT/train-8b-$mode.err" | head -3
    python3 - "/tmp/dist1-$mode/metrics.jsonl" "$mode" <<'PY'
import json, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get("type") == "step"]
late = [r for r in steps if r["step"] > 10]
t = late[-1]["elapsed_s"] - steps[9]["elapsed_s"]
print(sys.argv[2], len(steps), "steps;", "samples/s after step 10:", round(sum(r["samples"] for r in late) / t, 3))
PY
  done
  ;;
*) echo "usage: $0 pack|check|anchors|bench|room|gdn|probe|dist1"; exit 2 ;;
esac
t done
