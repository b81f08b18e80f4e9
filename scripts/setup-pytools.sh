#!/usr/bin/env bash
# Python tools used by tests and benchmarks (not by dflash-tui itself): Hugging Face `datasets`
# (checks that prepare-data output opens with datasets.load_from_disk), pyarrow (the
# comparison in bench-data) and TensorBoard (reads back the event files a run writes).
# Installed into .deps/pytools (git-ignored); use them with PYTHONPATH=.deps/pytools.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
target="$root/.deps/pytools"
stamp="$target/.installed-datasets-5.2.0-tensorboard-2.21.0"
if [ ! -f "$stamp" ]; then
  echo "setup: installing datasets==5.2.0 (with pyarrow) and tensorboard==2.21.0 into $target"
  rm -rf "$target"
  "$py" -m pip install --quiet --disable-pip-version-check --target "$target" \
    "datasets==5.2.0" "tensorboard==2.21.0"
  touch "$stamp"
fi
