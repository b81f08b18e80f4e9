#!/usr/bin/env bash
# The recipe's state across GPU sessions: the regenerated data (regen*.tar.xz.*) and the best
# drafter (drafter.safetensors.* + drafter-config.json) that lab/smollm2-dflash.sh returned, and
# the drafter's eval reports (eval-*.json.xz: per prompt, for tools/eval_compare.py against a
# later drafter). Saved outside git's history: every byte committed there is downloaded by every
# clone. A save is a folder of the store, $RECIPE_STATES (default: release-assets/recipe-state/
# in the checkout, git-ignored); a state that is a published result goes out as a release asset,
# a tar of its folder (the command is printed by save).
#
#   lab/recipe-state.sh save SRC "what it is"   the files of SRC into a new folder of the store,
#                                               with a MANIFEST (the note and sha256 sums)
#   lab/recipe-state.sh restore DEST [SAVE]     a save into DEST, checksums verified. SAVE: a
#                                               folder of the store (its name or a path), a tar
#                                               of one (a downloaded release asset), or a commit
#                                               of the saves made into git history before this
#                                               script stopped doing that (e.g. 56c83d8);
#                                               default: the newest save in the store
#   lab/recipe-state.sh list                    the store's saves, then the history's, newest first
#
# A save is about 26 MB of data and 37 MiB (5 layers) to 77 MiB (11 layers) of drafter.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=recipe-state
# paths as the caller wrote them, relative to where it stands
store=$(realpath -m -- "${RECIPE_STATES:-$root/release-assets/recipe-state}")
case "${1:-}" in
save | restore) [ -n "${2:-}" ] && set -- "$1" "$(realpath -m -- "$2")" "${@:3}" ;;
esac
if [ "${1:-}" = restore ] && [ -n "${3:-}" ] && [ -e "$3" ]; then
  set -- "$1" "$2" "$(realpath -- "$3")"
fi
cd "$root"

history_saves() { git log --format='%H %cs %s' --diff-filter=A "$@" -- "$dir/MANIFEST"; }
store_saves() {
  [ -d "$store" ] || return 0
  find "$store" -mindepth 2 -maxdepth 2 -name MANIFEST -printf '%h\n' | sort -r
}

# DEST must be new or empty: pieces left from another save would be joined with these
check_dest() {
  if [ -d "$1" ] && [ -n "$(ls -A "$1")" ]; then
    echo "$1 is not empty; restore into a new or empty folder" >&2
    exit 1
  fi
  mkdir -p "$1"
}

case "${1:-}" in
save)
  src=${2:?usage: $0 save SRC "what it is"}
  note=${3:?usage: $0 save SRC "what it is"}
  [ -d "$src" ] || { echo "$src: no such folder" >&2; exit 1; }
  shopt -s nullglob
  files=("$src"/regen*.tar.xz.* "$src"/drafter.safetensors.* "$src"/drafter-config.jso[n])
  [ ${#files[@]} -gt 0 ] || { echo "$src: no regen*.tar.xz.*, drafter.safetensors.* or drafter-config.json" >&2; exit 1; }
  files+=("$src"/eval-*.json.xz)
  name=$(date -u +%Y%m%d-%H%M%S)
  out=$store/$name
  [ -e "$out" ] && { echo "$out exists; try again in a second" >&2; exit 1; }
  mkdir -p "$out.partial"
  cp "${files[@]}" "$out.partial/"
  sums=$(cd "$out.partial" && sha256sum -- *)
  printf '# %s\n%s\n' "$note" "$sums" > "$out.partial/MANIFEST"
  mv "$out.partial" "$out"
  echo "saved in $out"
  echo "to publish it as a release asset: tar -cf recipe-state-$name.tar -C $store $name"
  ;;
restore)
  dest=${2:?usage: $0 restore DEST [SAVE]}
  save=${3:-$(store_saves | head -1)}
  [ -n "$save" ] || { echo "no save in $store; name one (a folder, a tar or a commit)" >&2; exit 1; }
  [ -d "$store/$save" ] && save=$store/$save
  if [ -d "$save" ]; then
    check_dest "$dest" && cp -- "$save"/* "$dest/"
  elif [ -f "$save" ]; then
    check_dest "$dest" && tar -xf "$save" -C "$dest" --strip-components=1
  elif git rev-parse -q --verify "$save^{commit}" >/dev/null; then
    check_dest "$dest" && git archive "$save" "$dir" | tar -x -C "$dest" --strip-components=1
  else
    echo "$save: not a save of $store, a tar or a commit" >&2
    exit 1
  fi
  [ -f "$dest/MANIFEST" ] || { echo "$save: no MANIFEST (not a recipe state)" >&2; exit 1; }
  (cd "$dest" && head -1 MANIFEST && tail -n +2 MANIFEST | sha256sum -c --quiet) || {
    echo "$dest: checksums of the save $save do not match" >&2
    exit 1
  }
  echo "restored $save into $dest"
  ;;
list)
  for s in $(store_saves); do echo "$(basename "$s") $(head -1 "$s/MANIFEST")"; done
  history_saves
  ;;
*)
  echo "usage: $0 save SRC \"what it is\" | restore DEST [SAVE] | list" >&2
  exit 2
  ;;
esac
