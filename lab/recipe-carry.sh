#!/usr/bin/env bash
# The inputs of lab/smollm2-dflash.sh for a GPU machine that takes at most 64 MiB a call,
# packed into folders of at most 60 MB: .carry/c1, .carry/c2, ... Each call carries one folder
# and copies it into $W (`cp -r .carry/cN/* /tmp/w/`); the last call then runs the stage.
#
#   lab/recipe-carry.sh [STATE] [--sharegpt]      (after `make setup`)
#
# Packed: the stripped release binary (xz), the demo GGUF (xz, in 40 MB pieces), MT-Bench's
# questions, z-lab's dflash==0.1.0 wheel (for the public check), and either STATE (a folder from
# lab/recipe-state.sh restore: regenerated data and a drafter; no regeneration needed) or,
# without it, the demo ShareGPT file (xz, 18 MB) for the data stage. --sharegpt packs that file
# with STATE too: the `more` stage needs it to sample answer sets the state does not hold yet
# (e.g. SEED=3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
state= sharegpt=
for arg in "$@"; do
  case "$arg" in
  --sharegpt) sharegpt=1 ;;
  -*) echo "usage: $0 [STATE] [--sharegpt]" >&2; exit 2 ;;
  *) [ -z "$state" ] || { echo "usage: $0 [STATE] [--sharegpt]" >&2; exit 2; }
     state=$(realpath -- "$arg") ;;
  esac
done
[ -z "$state" ] && sharegpt=1
cd "$root"
gguf=.deps/pkgs/SmolLM2-135M-Instruct.Q4_1.gguf
for f in "$gguf" assets/demo/mt-bench.jsonl; do
  [ -f "$f" ] || { echo "$f missing: run make setup first" >&2; exit 1; }
done
if [ -n "$state" ]; then
  [ -f "$state/MANIFEST" ] || { echo "$state: no MANIFEST (not a lab/recipe-state.sh restore)" >&2; exit 1; }
fi
if [ -n "$sharegpt" ] && [ ! -f assets/demo/sharegpt.jsonl ]; then
  echo "assets/demo/sharegpt.jsonl missing: run make setup first" >&2
  exit 1
fi

grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
staging=.carry/staging
rm -rf .carry/c[0-9]* "$staging"
mkdir -p "$staging/whl"
echo "compressing (a few minutes on 2 cores)"
make -s carry   # the stripped binary, .carry/dflash-tui
xz -9 -T0 -c .carry/dflash-tui > "$staging/dflash-tui.xz"
xz -9 -T0 -c "$gguf" | split -b 40000000 - "$staging/gg."
cp assets/demo/mt-bench.jsonl "$staging/"
python3 -m pip download -q --disable-pip-version-check --no-deps -d "$staging/whl" dflash==0.1.0
if [ -n "$state" ]; then
  shopt -s nullglob
  cp "$state"/regen*.tar.xz.* "$state"/drafter.safetensors.* "$state"/drafter-config.jso[n] "$staging/"
  shopt -u nullglob
fi
if [ -n "$sharegpt" ]; then
  xz -9 -T0 -c assets/demo/sharegpt.jsonl > "$staging/sharegpt.jsonl.xz"
fi

# first fit, largest first, into folders of at most 60 MB (the tree itself travels too)
limit=60000000
n=0
declare -A used=()
while read -r size name; do
  placed=
  for ((i = 1; i <= n; i++)); do
    if ((used[$i] + size <= limit)); then placed=$i; break; fi
  done
  if [ -z "$placed" ]; then n=$((n + 1)); placed=$n; used[$n]=0; mkdir -p ".carry/c$n"; fi
  used[$placed]=$((used[$placed] + size))
  mv "$staging/$name" ".carry/c$placed/"
done < <(cd "$staging" && du -sb -- * | sort -rn)
rmdir "$staging"
for ((i = 1; i <= n; i++)); do
  echo ".carry/c$i: $(ls ".carry/c$i" | tr '\n' ' ')($((used[$i] / 1000000)) MB)"
done
