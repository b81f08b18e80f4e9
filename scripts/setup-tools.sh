#!/usr/bin/env bash
# Command-line tools the tests use: tmux drives the control room end to end.
set -euo pipefail
if ! command -v tmux >/dev/null 2>&1; then
  echo "setup: installing tmux (Debian package)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq tmux >/dev/null
  else
    sudo apt-get update -qq && sudo apt-get install -y -qq tmux >/dev/null
  fi
fi
