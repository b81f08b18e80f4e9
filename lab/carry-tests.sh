#!/usr/bin/env bash
# Builds the test binaries and copies the library's, tests/trainer.rs's and tests/gpu_decode.rs's,
# stripped, into .carry/tests/ for the GPU machine (which has no cargo): there, from the repo
# root, `.carry/tests/lib --ignored nccl` and `.carry/tests/trainer --ignored nccl` run the
# two-GPU NCCL checks (docs/training.md, "Data-parallel replicas"), `.carry/tests/gpu_decode --ignored
# gpu` the GPU decoding checks.
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
    if name in ("lib", "trainer", "gpu_decode"):
        shutil.copy(m["executable"], ".carry/tests/" + name)
        print(name, "<-", m["executable"])
'
strip .carry/tests/lib .carry/tests/trainer .carry/tests/gpu_decode
ls -la .carry/tests
