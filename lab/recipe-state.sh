#!/usr/bin/env bash
# The recipe's state across sessions whose only lasting store is this repository's history:
# the regenerated data (regen*.tar.xz.*) and the best drafter (drafter.safetensors.* +
# drafter-config.json) that scripts/smollm2-dflash.sh returned, and the drafter's eval reports
# (eval-*.json.xz: per prompt, for scripts/eval_compare.py against a later drafter), kept in git
# history but not in the tree (which travels to the GPU machine on every call and must stay small).
#
#   scripts/recipe-state.sh save SRC "what it is"   two commits: recipe-state/ added, then removed
#   scripts/recipe-state.sh restore DEST [COMMIT]   the pieces of COMMIT (default: the latest
#                                                   save) into DEST, checksums verified
#   scripts/recipe-state.sh list                    the saves, newest first
#
# A save is about 26 MB of data and 37 MiB (5 layers) or 57 MiB (8 layers) of drafter in the
# history; restore reads it back with `git archive`, so a fresh clone needs nothing else.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=recipe-state
# SRC and DEST as the caller wrote them, relative to where it stands
[ -n "${2:-}" ] && set -- "$1" "$(realpath -m -- "$2")" "${@:3}"
cd "$root"

saves() { git log --format='%H %cs %s' --diff-filter=A "$@" -- "$dir/MANIFEST"; }

case "${1:-}" in
save)
  src=${2:?usage: $0 save SRC "what it is"}
  note=${3:?usage: $0 save SRC "what it is"}
  [ -e "$dir" ] && { echo "$dir/ exists in the tree; remove it first" >&2; exit 1; }
  [ -d "$src" ] || { echo "$src: no such folder" >&2; exit 1; }
  shopt -s nullglob
  files=("$src"/regen*.tar.xz.* "$src"/drafter.safetensors.* "$src"/drafter-config.jso[n])
  [ ${#files[@]} -gt 0 ] || { echo "$src: no regen*.tar.xz.*, drafter.safetensors.* or drafter-config.json" >&2; exit 1; }
  files+=("$src"/eval-*.json.xz)
  mkdir "$dir"
  cp "${files[@]}" "$dir/"
  sums=$(cd "$dir" && sha256sum -- *)
  printf '# %s\n%s\n' "$note" "$sums" > "$dir/MANIFEST"
  git add -f "$dir"
  git commit -q -m "Recipe state: $note" \
    -m "Kept in history only (the next commit takes it out of the tree): scripts/recipe-state.sh restore DEST" \
    -- "$dir"
  saved=$(git rev-parse HEAD)
  git rm -r -q "$dir"
  git commit -q -m "Recipe state out of the tree (saved in ${saved:0:10}: scripts/recipe-state.sh restore DEST ${saved:0:10})" \
    -- "$dir"
  echo "saved in $saved"
  ;;
restore)
  dest=${2:?usage: $0 restore DEST [COMMIT]}
  commit=${3:-$(saves -1 | cut -d' ' -f1)}
  [ -n "$commit" ] || { echo "no save of $dir/ in this history" >&2; exit 1; }
  # an empty folder: pieces left from another save would be joined with these
  if [ -d "$dest" ] && [ -n "$(ls -A "$dest")" ]; then
    echo "$dest is not empty; restore into a new or empty folder" >&2
    exit 1
  fi
  mkdir -p "$dest"
  git archive "$commit" "$dir" | tar -x -C "$dest" --strip-components=1
  (cd "$dest" && head -1 MANIFEST && tail -n +2 MANIFEST | sha256sum -c --quiet) || {
    echo "$dest: checksums of the save $commit do not match" >&2
    exit 1
  }
  echo "restored $commit into $dest"
  ;;
list)
  saves
  ;;
*)
  echo "usage: $0 save SRC \"what it is\" | restore DEST [COMMIT] | list" >&2
  exit 2
  ;;
esac
