#!/usr/bin/env python3
"""Totals of a profiler trace (Chrome trace JSON, as `dflash-tui eval --trace FILE` and
torch.profiler's `export_chrome_trace` write it): the device kernels, copies and fills by name
(count, total, mean, share of the device-busy time), and the CPU operators by self time (their
time minus that of the operators they called). Where the program marked the parts of its steps
(named ranges, as torch.profiler.record_function makes: "user_annotation" events, e.g. eval's
"dflash draft", "dflash verify", "greedy step"), the device time is also totalled per range
name: each kernel belongs to the innermost range around the launch that queued it (matched by
the launch's correlation id, which also holds for the kernels of a replayed CUDA graph). Standard library only, so that it runs where
the trace was made and only its summary has to travel.

  python3 tools/trace_summary.py TRACE.json [--top 25]
"""
import argparse
import collections
import json

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def table(title, totals, top, busy=None):
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    all_us = sum(t for _, t in totals.values())
    print(f"{title}: {len(totals)} names, {sum(n for n, _ in totals.values())} events, {all_us / 1e3:.3f} ms")
    print(f"{'count':>8} {'total ms':>10} {'mean us':>9} {'share':>6}  name")
    for name, (n, us) in rows[:top]:
        share = 100 * us / (busy or all_us or 1)
        print(f"{n:8d} {us / 1e3:10.3f} {us / max(n, 1):9.2f} {share:5.1f}%  {name[:110]}")
    print()


def device_totals(events):
    totals = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for e in events:
        if e.get("cat") in DEVICE and e.get("ph") == "X":
            t = totals[f"[{e['cat']}] {e.get('name', '?')}"]
            t[0] += 1
            t[1] += float(e.get("dur", 0))
            spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    # busy time: the union of the intervals (kernels of several streams may overlap)
    busy, end = 0.0, None
    for s, f in sorted(spans):
        if end is None or s > end:
            busy += f - s
            end = f
        elif f > end:
            busy += f - end
            end = f
    first = min((s for s, _ in spans), default=0.0)
    last = max((f for _, f in spans), default=0.0)
    return totals, busy, last - first


def cpu_self_totals(events):
    """Self time of the CPU operators: nested calls (same thread) subtracted."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for ops in by_thread.values():
        ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        stack = []  # [end, name, child time]
        for e in ops:
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            while stack and stack[-1][0] <= ts:
                end, name, child, own = stack.pop()
                totals[name][1] += own - child
            if stack:
                stack[-1][2] += dur
            totals[e["name"]][0] += 1
            stack.append([ts + dur, e["name"], 0.0, dur])
        while stack:
            end, name, child, own = stack.pop()
            totals[name][1] += own - child
    return totals


def range_totals(events):
    """Device time per named range: {name: [ranges, kernels, device us, {kernel: [n, us]}]}."""
    ranges = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X":
            ts = float(e["ts"])
            ranges[(e.get("pid"), e.get("tid"))].append((ts, ts + float(e.get("dur", 0)), e["name"]))
    if not ranges:
        return {}
    owner = {}  # correlation id of a launch -> the innermost range around it
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X":
            corr = (e.get("args") or {}).get("correlation")
            ts = float(e["ts"])
            inside = [r for r in ranges.get((e.get("pid"), e.get("tid")), []) if r[0] <= ts <= r[1]]
            if corr is not None and inside:
                owner[corr] = min(inside, key=lambda r: r[1] - r[0])[2]
    totals = {}
    for rs in ranges.values():
        for _, _, name in rs:
            totals.setdefault(name, [0, 0, 0.0, collections.defaultdict(lambda: [0, 0.0])])[0] += 1
    for e in events:
        if e.get("cat") in DEVICE and e.get("ph") == "X":
            name = owner.get((e.get("args") or {}).get("correlation"))
            if name is not None:
                t = totals[name]
                dur = float(e.get("dur", 0))
                t[1] += 1
                t[2] += dur
                k = t[3][f"[{e['cat']}] {e.get('name', '?')}"]
                k[0] += 1
                k[1] += dur
    return totals


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Chrome trace JSON file")
    p.add_argument("--top", type=int, default=25, help="rows per table")
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f).get("traceEvents", [])
    totals, busy, span = device_totals(events)
    if totals:
        print(f"device: busy {busy / 1e3:.3f} ms of {span / 1e3:.3f} ms from the first kernel to the last")
        table("device kernels, copies and fills", totals, args.top, busy)
    per_range = range_totals(events)
    if per_range:
        print("device time per named range (per range: mean kernels and device us)")
        print(f"{'ranges':>8} {'kernels':>8} {'device ms':>10} {'per range us':>13}  name")
        for name, (n, k, us, _) in sorted(per_range.items(), key=lambda kv: -kv[1][2]):
            print(f"{n:8d} {k / max(n, 1):8.1f} {us / 1e3:10.3f} {us / max(n, 1):13.1f}  {name}")
        print()
        for name, (n, _, us, kernels) in sorted(per_range.items(), key=lambda kv: -kv[1][2]):
            if kernels:
                table(f"kernels of the range \"{name}\" ({n} ranges)", kernels, args.top)
    table("CPU operators, self time", cpu_self_totals(events), args.top)


if __name__ == "__main__":
    main()
