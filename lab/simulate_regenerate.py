#!/usr/bin/env python3
"""A model of `regenerate`'s continuous engine (src/model/generate/continuous.rs), for choosing
its scheduling rules without a GPU: the answers' lengths of a regenerated dataset (its loss_mask
runs of 1, per turn) are replayed through SLOTS slots, one token per busy slot per decoding step,
each conversation's turns one after the other in its slot, prefills of the waiting slots by the
engine's rule. Time per decoding step = A + B * busy slots (ms; the defaults fit the all-turns
run of 2026-12-01 on one H200, 1,024 slots: 11,450 simulated steps against 11,378 measured,
127.3 s against 126.7 s); a prefill costs 3 ms + 26 ms per 128 slots.

  python3 lab/simulate_regenerate.py REGENERATED_DATASET [--slots 1024] [--rule occupied]

Needs pyarrow. Prints decoding steps, simulated seconds and tokens/s, the busy share of
slot-steps, and the steps after 99 % of the tokens (the drain).
"""
import argparse
import glob
import os

import pyarrow as pa


def answer_lengths(dataset):
    """Per row (train split, then validation), the lengths of its answers in order."""
    rows = []
    for split in ("train", "validation"):
        for path in sorted(glob.glob(os.path.join(dataset, split, "*.arrow"))):
            with open(path, "rb") as f:
                table = pa.ipc.open_stream(f).read_all()
            for mask in table.column("loss_mask").to_pylist():
                runs, start = [], 0
                for i in range(1, len(mask) + 1):
                    if i == len(mask) or mask[i] != mask[start]:
                        if mask[start] == 1:
                            runs.append(i - start)
                        start = i
                if runs:
                    rows.append(runs)
    return rows


def simulate(rows, slots, rule, a_ms, b_ms):
    pending = list(reversed(range(len(rows))))
    state = [None] * slots  # [row, turn, tokens left] or None
    waiting = set()
    t, steps, busy_sum, tokens, marks = 0.0, 0, 0, 0, []
    while True:
        for i in range(slots):
            if state[i] is None and pending:
                r = pending.pop()
                state[i] = [r, 0, rows[r][0]]
                waiting.add(i)
        decoding = [i for i in range(slots) if state[i] is not None and i not in waiting]
        if not decoding and not waiting:
            break
        occupied = len(waiting) + len(decoding)
        base = slots if rule == "slots" else occupied
        if waiting and (not decoding or len(waiting) * 8 >= base):
            t += 0.003 + 0.026 * len(waiting) / 128
            waiting.clear()
            continue
        marks.append(tokens)
        t += (a_ms + b_ms * len(decoding)) / 1000
        steps += 1
        busy_sum += len(decoding)
        tokens += len(decoding)
        for i in decoding:
            s = state[i]
            s[2] -= 1
            if s[2] <= 0:
                s[1] += 1
                if s[1] < len(rows[s[0]]):
                    s[2] = rows[s[0]][s[1]]
                    waiting.add(i)
                else:
                    state[i] = None
    drain = sum(1 for k in marks if k >= 0.99 * tokens)
    return steps, t, tokens, busy_sum / max(1, steps * slots), drain


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", help="a regenerated dataset folder (train/ and validation/ Arrow files)")
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument(
        "--rule",
        choices=["occupied", "slots"],
        default="occupied",
        help="prefill once an eighth of the occupied slots wait (now) or of all slots (before)",
    )
    p.add_argument("--a-ms", type=float, default=2.2, help="fixed cost of a decoding step")
    p.add_argument("--b-ms", type=float, default=0.0112, help="cost per busy slot of a step")
    args = p.parse_args()
    rows = answer_lengths(args.dataset)
    steps, t, tokens, busy, drain = simulate(rows, args.slots, args.rule, args.a_ms, args.b_ms)
    print(
        f"{len(rows)} rows, {tokens} tokens, {args.slots} slots, rule {args.rule}: {steps} decoding "
        f"steps, {t:.1f} s, {tokens / t:.0f} tokens/s, {100 * busy:.0f} % of slot-steps busy, "
        f"{drain} steps after 99 % of the tokens"
    )


if __name__ == "__main__":
    main()
