"""Prints the headline numbers of `dflash-tui eval --json` reports, one block per file:
tau and its 95 % interval over prompts, speed-up and its spread, the step's cost in greedy
steps, where the step's time goes, mismatches, acceptance by block slot.

usage: python3 eval_summary.py REPORT.json [REPORT.json ...]
"""

import json
import sys

KEYS = ["tau", "tau_ci95", "speedup", "speedup_spread", "greedy_ms_per_token", "dflash_ms_per_step",
        "step_cost_in_greedy_steps", "mismatches", "cuda_graphs", "warmup_prompts"]

for path in sys.argv[1:]:
    try:
        with open(path) as f:
            r = json.load(f)
    except (OSError, ValueError) as e:
        print(path, "no report:", e)
        continue
    print(path, len(r["prompts"]), "prompts", {k: r.get(k) for k in KEYS})
    print("  dflash step ms", r["dflash_step_ms"])
    print("  greedy step ms", r["greedy_step_ms"])
    print("  accepted by slot", r["accepted_by_slot"])
