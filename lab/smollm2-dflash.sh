#!/usr/bin/env bash
# The SmolLM2-135M-Instruct DFlash recipe on one GPU (configs/smollm2-dflash.toml), in stages of
# at most 10 minutes each, for machines lent by the call
# (results: docs/results/smollm2.md; how it runs: lab/README.md):
#
#   W=/tmp/w OUT=$OUT bash lab/smollm2-dflash.sh data|more|train|rest|ablate|eval|trace|regen-bench
#
# data   import the demo GGUF, tokenise all 17,671 demo conversations (train / validation
#        splits) and regenerate EVERY assistant turn with the target (greedy, continuous
#        batching, CUDA graph): the drafter learns the target's own answers.
# more   a sampled second answer to every turn of the training conversations (TEMP, SEED),
#        added to the training split of the regenerated data (run after data, before train);
#        returns regen-more-SEED.tar.xz.*, which a fresh machine adds back without the GPU.
# train  train the drafter for TRAIN_S seconds (a SIGINT then checkpoints) and STEPS steps,
#        at learning rate LR (default: the config's), with SET="section.field=value ..."
#        (further settings of a new run); the validation pass every
#        validation.every_steps keeps the best drafter in run/best. A second call on the same
#        machine resumes the run (STEPS then stretches its schedule to that many steps, e.g.
#        when the first call ended early); on a fresh machine with a previous stage's drafter carried
#        in (drafter.safetensors.* + drafter-config.json) a new run starts from it
#        (SET="model.drafter_added_layers=3": with three more layers, starting as the identity).
# ablate one run of an equal budget (TRAIN_S seconds, STEPS steps) on the first ROWS training
#        conversations (0 = all) with LAYERS drafter layers, then `eval` of its best drafter on
#        the 100 ShareGPT prompts: where tau stalls, a row per (ROWS, LAYERS) shows whether more
#        data or a bigger drafter moves it (one call each, e.g. ROWS=1700, 5000, 0; LAYERS=2, 8).
# regen-bench  regenerate's speed (outputs discarded): the first answers of 10,000 conversations
#        at batch 384, then every turn of all of them at BATCH slots (default 1024);
#        TRACE_STEPS=FIRST:COUNT adds a profiler trace of those decoding steps, totalled;
#        RUNS=all (or first) runs only that workload.
# eval   `eval` of $RUN/best/drafter at batch 1, bf16, CUDA graphs: 100 held-out ShareGPT
#        prompts and MT-Bench's 80 first turns, 128 new tokens each; 20 prompts in f32
#        (lossless); the drafter in z-lab's public implementation (tools/check_public_dflash.py).
#        TRACE=1: also the trace stage. QUICK=1: the two bf16 sets only.
# trace  a profiler trace of one prompt's decoding (greedy, then DFlash), totalled by kernel
#        and by part of a step (tools/trace_summary.py; the summary is returned, the trace
#        stays in $W).
#
# Every stage first looks for what the previous one made in $W (a warm machine); on a fresh
# machine it takes what the previous stage returned, carried into $W:
#   data  returns regen.tar.xz.*  (the regenerated dataset, xz, in pieces under 16 MiB)
#   train returns drafter.safetensors.* + drafter-config.json (the best drafter in 15 MiB
#         pieces: carried back, it starts a new run through model.drafter_init)
# The stages' logs and JSON (train.out, metrics.jsonl, eval-*.json, public.json, ...) come back
# gzipped in one tar, logs.tar (`tar -xf logs.tar && gunzip *.gz`). A call brings back at most
# 8 files and 64 MiB in all: train returns as many of the drafter's pieces as fit beside
# logs.tar (4 of 15 MiB; an 11-layer drafter has 6) and names those left, which the next call
# on the same machine brings back with
# rest   the drafter's pieces that the last train stage could not return.
# RUN=NAME (default run): the run folder $W/NAME of train, rest, eval and trace. Two names on
# one machine are two arms from the same carried drafter (e.g. with and without a SET), each
# measured with QUICK=1 eval; `rest` with an arm's name then returns the rest of that arm's
# drafter, and with AGAIN=1 all of it (two calls for 11 layers).
# What a session returned outlives it in the recipe-state store (not in git): lab/recipe-state.sh
# save / restore.
# Inputs in $W: dflash-tui (or dflash-tui.xz), gg.* (the demo GGUF, xz-compressed, in pieces),
# sharegpt.jsonl.xz, mt-bench.jsonl, whl/ (the dflash==0.1.0 wheel: z-lab's implementation, run on
# the machine's own torch and transformers).
set -uo pipefail
TL=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))" 2>/dev/null)/lib
export LD_LIBRARY_PATH=$TL NCCL_NVLS_ENABLE=0
W=${W:-/tmp/w}
OUT=${OUT:-/tmp/out}
CONFIG=${CONFIG:-configs/smollm2-dflash.toml}
# RUN: the run's folder under $W (train, rest, eval and trace use it); runs of other names on
# one machine are arms of a comparison that start from the same carried drafter
RUN=${RUN:-run}
R=$W/$RUN
BACK=$W/back-$RUN
mkdir -p "$OUT" "$W"
t() { echo "== $(date +%T) $*"; }
B=$W/dflash-tui
[ -x "$B" ] || { xz -dc "$W/dflash-tui.xz" > "$B" && chmod +x "$B"; } || exit 1

model() { # the target model folder
  [ -f "$W/smol/model.safetensors" ] && return 0
  t import
  cat "$W"/gg.* | xz -dc > "$W/smol.gguf" || return 1
  "$B" import-gguf "$W/smol.gguf" "$W/smol" --dtype bf16 2>&1 | tail -1
}

carried_drafter() { # $W/drafter-in from a previous stage's pieces; fails when none came
  [ -f "$W/drafter-in/model.safetensors" ] && return 0
  [ -f "$W/drafter-config.json" ] || return 1
  mkdir -p "$W/drafter-in" && cat "$W"/drafter.safetensors.* > "$W/drafter-in/model.safetensors" &&
    cp "$W/drafter-config.json" "$W/drafter-in/config.json"
}

drafter() { # D: the drafter to evaluate (this machine's best, else the one carried in)
  D=$R/best/drafter
  [ -f "$D/model.safetensors" ] && return 0
  D=$W/drafter-in
  carried_drafter
}

bundle() { # bundle FILE...: those of the files in $OUT that exist, gzipped, appended to
  # $OUT/logs.tar (one file back however many stages a call runs) and removed
  local f have=()
  for f in "$@"; do [ -f "$OUT/$f" ] && have+=("$f"); done
  [ ${#have[@]} -gt 0 ] || return 0
  (cd "$OUT" && gzip -f -- "${have[@]}" && tar -rf logs.tar -- "${have[@]/%/.gz}" &&
    rm -f -- "${have[@]/%/.gz}")
}

give() { # give DIR: DIR's files into $OUT in name order, as many as a call brings back (64 MiB
  # in all; 2 MiB kept for logs.tar, which later stages of the call append to); those left stay
  # in DIR for the `rest` stage of the next call
  local room=$((62 * 1024 * 1024)) used size f
  used=$(du -sb -- "$OUT" | cut -f1)
  for f in "$1"/*; do
    [ -f "$f" ] || continue
    size=$(stat -c %s -- "$f")
    ((used + size <= room)) || break
    mv -- "$f" "$OUT/" && used=$((used + size))
  done
  if compgen -G "$1/*" > /dev/null; then
    echo "NOT RETURNED (64 MiB a call): $(cd "$1" && echo *); the next call on this machine: W=$W OUT=\$OUT bash lab/smollm2-dflash.sh rest"
  fi
}

pack_best() { # $R's best drafter into $BACK in 15 MiB pieces (for give) and its config into
  # $OUT; fails when the run has no best drafter
  rm -rf "$BACK"
  [ -f "$R/best/drafter/model.safetensors" ] || return 1
  cp "$R/best/drafter/config.json" "$OUT/drafter-config.json" && mkdir -p "$BACK" &&
    split -b 15M "$R/best/drafter/model.safetensors" "$BACK/drafter.safetensors."
}

summary() { # the first $1 lines of inspect-data's summary of $W/regen (read whole: with
  # pipefail, a `| head` that stops reading would fail the stage)
  "$B" inspect-data "$W/regen" > "$W/inspect.txt" 2>&1 && head -"$1" "$W/inspect.txt"
}

regen() { # the regenerated dataset, unpacked
  [ -f "$W/regen/dataset_dict.json" ] || { cat "$W"/regen.tar.xz.* | xz -dc | tar -C "$W" -xf -; }
}

prepared() { # the demo conversations, tokenised (train / validation splits)
  [ -f "$W/sg/dataset_dict.json" ] && return 0
  t prepare
  xz -dc "$W/sharegpt.jsonl.xz" > "$W/sharegpt.jsonl" &&
    "$B" prepare-data --tokenizer "$W/smol" --input "$W/sharegpt.jsonl" --out "$W/sg" \
      --max-len "${MAX_LEN:-2048}" 2>&1 | tail -4
}

trace() { # a profiler trace of one prompt's decoding (greedy, then DFlash), totalled
  t trace
  "$B" eval --target "$W/smol" --drafter "$D" --data "$W/regen" --limit 2 --max-new-tokens 128 \
    --trace "$W/trace.json" > /dev/null 2> "$OUT/trace.err" &&
    python3 tools/trace_summary.py "$W/trace.json" --top 40 > "$OUT/trace-summary.txt"
  head -60 "$OUT/trace-summary.txt"
  bundle trace.err trace-summary.txt
}

case "${1:-}" in
data)
  model && prepared || exit 1
  t regenerate
  "$B" regenerate --target "$W/smol" --input "$W/sg" --out "$W/regen" \
    --max-new-tokens "${MAX_NEW:-512}" --max-len "${MAX_LEN:-2048}" \
    --batch-size "${BATCH:-1024}" ${LIMIT:+--limit $LIMIT} 2> "$OUT/regenerate.err"
  grep -E "regenerate on|tokens/s\)" "$OUT/regenerate.err" | tail -3
  summary 12
  t pack
  tar -C "$W" -cf - regen | xz -T0 -3 | split -b 15M - "$OUT/regen.tar.xz."
  bundle regenerate.err
  ls -la "$OUT"
  ;;
more)
  # a second answer to every turn of the training conversations, sampled at TEMP (default
  # 0.7) with SEED (default 1), added to the training split of $W/regen: twice the distinct
  # training tokens from the same conversations; the validation split stays the greedy one.
  # Returns the answers as regen-more-SEED.tar.xz.*; carried into $W on a fresh machine, they
  # are added again without regenerating (run this stage before train there).
  TEMP=${TEMP:-0.7} SEED=${SEED:-1}
  more=$W/regen-more-$SEED
  model && regen || exit 1
  if [ -f "$W/regen/train/more-$SEED.done" ]; then
    echo "already added"
  else
    if compgen -G "$more.tar.xz.*" > /dev/null; then
      t "unpack the sampled answers of seed $SEED"
      rm -rf "$more" && cat "$more".tar.xz.* | xz -dc | tar -C "$W" -xf - || exit 1
    else
      prepared || exit 1
      rm -rf "$more"
      t "regenerate sampled: temperature $TEMP, seed $SEED"
      "$B" regenerate --target "$W/smol" --input "$W/sg/train" --out "$more" \
        --temperature "$TEMP" --seed "$SEED" --max-new-tokens "${MAX_NEW:-512}" \
        --max-len "${MAX_LEN:-2048}" --batch-size "${BATCH:-1024}" ${LIMIT:+--limit $LIMIT} \
        2> "$OUT/regenerate-more-$SEED.err" || { grep -v "^frame" "$OUT/regenerate-more-$SEED.err" | tail -3; exit 1; }
      grep -E "regenerate on|tokens/s\)" "$OUT/regenerate-more-$SEED.err" | tail -3
      tar -C "$W" -cf - "$(basename "$more")" | xz -T0 -3 | split -b 15M - "$OUT/$(basename "$more").tar.xz."
      bundle "regenerate-more-$SEED.err"
    fi
    # the Hugging Face layout: a split is the Arrow files its state.json lists
    python3 lab/add_split_files.py "$more/train" "$W/regen/train" "more-$SEED-" &&
      touch "$W/regen/train/more-$SEED.done" || exit 1
  fi
  summary 6
  ;;
train)
  model && regen || exit 1
  args=(--config "$CONFIG" --no-tui --set model.target="$W/smol" --set data.path="$W/regen")
  if [ -e "$R/checkpoints/latest" ]; then
    args=(--resume "$R" --no-tui)
    # STEPS on a resume: the run's schedule stretched (or cut) to that many steps
    [ -n "${STEPS:-}" ] && args+=(--allow-schedule-change --set train.total_steps="$STEPS")
  else
    args+=(--run-dir "$R" --set train.total_steps="${STEPS:-4000}" ${LR:+--set train.lr=$LR})
    # SET="section.field=value ...": further settings of the new run
    for kv in ${SET:-}; do args+=(--set "$kv"); done
    # a previous stage's drafter, carried in, starts the new run
    if [ -f "$W/drafter-in/model.safetensors" ] || [ -f "$W/drafter-config.json" ]; then
      carried_drafter || exit 1
      args+=(--set model.drafter_init="$W/drafter-in")
    fi
  fi
  t "train ${args[*]}"
  timeout -s INT "${TRAIN_S:-540}" "$B" train "${args[@]}" > "$OUT/train.out" 2>&1
  echo "train exit $?"
  grep -E "validation at|eval at|checkpoint|run finished|stopp" "$OUT/train.out" | tail -25
  tail -4 "$OUT/train.out"
  cp "$R/metrics.jsonl" "$OUT/" 2>/dev/null
  bundle train.out metrics.jsonl
  cat "$R/best/eval.json" 2>/dev/null && echo
  if pack_best; then give "$BACK"; fi
  ;;
rest)
  # AGAIN=1: all of the run's best drafter again (e.g. when an earlier call's pieces were dropped)
  if [ -n "${AGAIN:-}" ] && ! pack_best; then
    echo "AGAIN: no best drafter in $R/best/drafter" >&2
    exit 1
  fi
  if compgen -G "$BACK/*" > /dev/null; then
    give "$BACK"
    ls -la "$OUT"
  else
    echo "nothing left to return in $BACK"
  fi
  ;;
ablate)
  model && regen || exit 1
  name="rows${ROWS:-0}-layers${LAYERS:-5}"
  rm -rf "$W/ablate-$name"
  t "ablate $name"
  timeout -s INT "${TRAIN_S:-240}" "$B" train --config "$CONFIG" --no-tui --run-dir "$W/ablate-$name" \
    --set model.target="$W/smol" --set data.path="$W/regen" --set data.max_samples="${ROWS:-0}" \
    --set model.drafter_layers="${LAYERS:-5}" --set train.total_steps="${STEPS:-1800}" \
    --set eval.every_steps=0 --set validation.patience=0 > "$OUT/train-$name.out" 2>&1
  grep -E "samples kept|validation at" "$OUT/train-$name.out" | tail -6
  cp "$W/ablate-$name/metrics.jsonl" "$OUT/metrics-$name.jsonl"
  "$B" eval --target "$W/smol" --drafter "$W/ablate-$name/best/drafter" --data "$W/regen" --limit 100 \
    --max-new-tokens 128 --json > "$OUT/eval-$name.json" 2> "$OUT/eval-$name.err"
  python3 tools/eval_summary.py "$OUT/eval-$name.json" | head -1
  bundle "train-$name.out" "metrics-$name.jsonl" "eval-$name.json" "eval-$name.err"
  ;;
trace)
  model && drafter && regen || exit 1
  trace
  ;;
eval)
  model && drafter && regen || exit 1
  t eval-sharegpt
  # the regenerated validation split: prompts up to the first answer (the same prompts as
  # the prepared split's; the answers are the target's)
  "$B" eval --target "$W/smol" --drafter "$D" --data "$W/regen" --limit "${PROMPTS:-100}" \
    --max-new-tokens 128 --json > "$OUT/eval-sharegpt.json" 2> "$OUT/eval-sharegpt.err"
  t eval-mtbench
  "$B" eval --target "$W/smol" --drafter "$D" --prompts "$W/mt-bench.jsonl" --limit 80 \
    --max-new-tokens 128 --json > "$OUT/eval-mtbench.json" 2> "$OUT/eval-mtbench.err"
  if [ -n "${QUICK:-}" ]; then
    # QUICK=1: the two bf16 sets only (an arm of a comparison; the f32 and public checks are
    # the kept drafter's, run later with RUN=NAME bash lab/smollm2-dflash.sh eval)
    python3 tools/eval_summary.py "$OUT"/eval-sharegpt.json "$OUT"/eval-mtbench.json
    bundle eval-sharegpt.json eval-sharegpt.err eval-mtbench.json eval-mtbench.err
    t done
    exit 0
  fi
  t eval-f32
  "$B" eval --target "$W/smol" --drafter "$D" --data "$W/regen" --limit 20 \
    --max-new-tokens 64 --dtype f32 --json > "$OUT/eval-f32.json" 2> "$OUT/eval-f32.err"
  python3 tools/eval_summary.py "$OUT"/eval-sharegpt.json "$OUT"/eval-mtbench.json "$OUT"/eval-f32.json
  [ -n "${TRACE:-}" ] && trace
  t public-check
  mkdir -p "$W/site"
  python3 -c "import zipfile,glob; [zipfile.ZipFile(w).extractall('$W/site') for w in glob.glob('$W/whl/dflash-*.whl')]"
  PYTHONPATH="$W/site" python3 tools/check_public_dflash.py "$W/smol" "$D" "$OUT/eval-f32.json" \
    --dtype f32 --max-new-tokens 64 > "$OUT/public.json" 2> "$OUT/public.err" \
    || { echo "public check exit $?"; tail -5 "$OUT/public.err"; }
  cat "$OUT/public.json"
  bundle eval-sharegpt.json eval-sharegpt.err eval-mtbench.json eval-mtbench.err \
    eval-f32.json eval-f32.err public.json public.err
  t done
  ;;
regen-bench)
  # regenerate's speed, two workloads (outputs discarded): the first answers of 10,000
  # conversations at batch 384 (the command the issue measured before the engines: 13,237
  # tokens/s), then every turn of all conversations at BATCH slots (default 1024).
  model || exit 1
  prepared || exit 1
  for run in "first --max-turns 1 --max-new-tokens 320 --limit 10000 --batch-size 384" \
             "all --max-new-tokens 512 --batch-size ${BATCH:-1024}"; do
    set -- $run
    name=$1; shift
    # RUNS=all (or first): only that workload
    [[ " ${RUNS:-first all} " == *" $name "* ]] || continue
    rm -rf "$W/bench-$name" "$W/bench-$name.partial"
    # TRACE_STEPS=FIRST:COUNT: a profiler trace of those decoding steps of each run, totalled
    trace=()
    [ -n "${TRACE_STEPS:-}" ] && trace=(--trace "$W/trace-$name.json" --trace-steps "$TRACE_STEPS")
    t "regenerate $name: $* ${trace[*]+${trace[*]}}"
    "$B" regenerate --target "$W/smol" --input "$W/sg" --out "$W/bench-$name" --max-len 2048 "$@" \
      ${trace[@]+"${trace[@]}"} 2> "$OUT/regen-$name.err" > "$OUT/regen-$name.out"
    echo "exit $?"
    grep -E "tokens generated|regenerate on" "$OUT/regen-$name.err" | tail -4
    tail -3 "$OUT/regen-$name.out"
    if [ -f "$W/trace-$name.json" ]; then
      python3 tools/trace_summary.py "$W/trace-$name.json" --top 40 > "$OUT/regen-trace-$name.txt"
      head -30 "$OUT/regen-trace-$name.txt"
    fi
    bundle "regen-$name.err" "regen-$name.out" "regen-trace-$name.txt"
    rm -rf "$W/bench-$name"
  done
  ;;
*)
  echo "usage: W=DIR OUT=DIR $0 data|more|train|rest|ablate|eval|trace|regen-bench" >&2
  exit 2
  ;;
esac
