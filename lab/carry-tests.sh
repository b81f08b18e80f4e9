#!/usr/bin/env bash
# Builds the test binaries and copies the library's and the integration tests' (tests/it/, the
# binary `it`), stripped, into .carry/tests/ for the GPU machine (which has no cargo): there, from
# the repo root, `.carry/tests/lib --ignored nccl` and `.carry/tests/it --ignored nccl` run the
# two-GPU NCCL checks (docs/training.md, "Data-parallel replicas"), `.carry/tests/it --ignored
# gpu_decode::` the GPU decoding checks (tests/it/gpu_decode.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/tests
cargo test --release --locked --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    t = m["target"]
    name = "lib" if "lib" in t["kind"] else t["name"] if t["kind"] == ["test"] else None
    if name in ("lib", "it"):
        shutil.copy(m["executable"], ".carry/tests/" + name)
        print(name, "<-", m["executable"])
'
strip .carry/tests/lib .carry/tests/it
ls -la .carry/tests
