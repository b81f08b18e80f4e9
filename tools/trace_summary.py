#!/usr/bin/env python3
"""Totals of a profiler trace (Chrome trace JSON, as `dflash-tui eval --trace FILE`,
`dflash-tui bench --trace FILE` and torch.profiler's `export_chrome_trace` write it): the device
kernels, copies and fills by name (count, total, mean, share of the device-busy time), and the
CPU operators by self time (their time minus that of the operators they called). Where the
program marked the parts of its steps (named ranges, as torch.profiler.record_function makes:
"user_annotation" events, e.g. eval's "dflash draft", "dflash verify", "greedy step"; bench's
"training step" and its parts "drafter.forward", "drafter.loss", "drafter.backward",
"grad.sync", "optim.step"), each range name gets its host (wall) time, the self time of the CPU
operators inside it and the device time of the kernels launched inside it: each kernel belongs
to the innermost range around the launch that queued it (matched by the launch's correlation
id, which also holds for the kernels of a replayed CUDA graph; a launch from a thread without a
range around it, as the autograd engine's thread running a backward pass on a GPU, counts in
the innermost range of any thread around it). --json prints it all as one object (for a
before/after comparison). Standard library only, so that it runs where the trace was made and
only its summary has to travel.

  python3 tools/trace_summary.py TRACE.json [--top 25] [--json]
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


class Ranges:
    """The named ranges of a trace ("user_annotation" events) per thread, and which one a
    moment of a thread lies in: the innermost of that thread's, else (work the program handed
    to another thread, as the autograd engine runs a CUDA backward pass on its own thread) the
    innermost of any thread's."""

    def __init__(self, events):
        self.by_thread = collections.defaultdict(list)
        for e in events:
            if e.get("cat") == "user_annotation" and e.get("ph") == "X":
                ts = float(e["ts"])
                self.by_thread[(e.get("pid"), e.get("tid"))].append((ts, ts + float(e.get("dur", 0)), e["name"]))
        self.all = [r for rs in self.by_thread.values() for r in rs]

    def __bool__(self):
        return bool(self.all)

    def owner(self, e):
        ts = float(e["ts"])
        for rs in (self.by_thread.get((e.get("pid"), e.get("tid")), []), self.all):
            inside = [r for r in rs if r[0] <= ts <= r[1]]
            if inside:
                return min(inside, key=lambda r: r[1] - r[0])[2]
        return None

    def host_totals(self):
        """{name: [ranges, wall us]}: the host time of each range name."""
        totals = collections.defaultdict(lambda: [0, 0.0])
        for start, end, name in self.all:
            totals[name][0] += 1
            totals[name][1] += end - start
        return totals


def cpu_self_totals(events, ranges=None):
    """Self time of the CPU operators: nested calls (same thread) subtracted. With `ranges`,
    also per range ({range: {operator: [n, us]}}, each call in the range its start lies in)."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    per_range = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)

    def close(entry):
        _, e, child, own = entry
        totals[e["name"]][1] += own - child
        name = ranges.owner(e) if ranges else None
        if name is not None:
            t = per_range[name][e["name"]]
            t[0] += 1
            t[1] += own - child

    for ops in by_thread.values():
        ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        stack = []  # [end, event, child time, own time]
        for e in ops:
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            while stack and stack[-1][0] <= ts:
                close(stack.pop())
            if stack:
                stack[-1][2] += dur
            totals[e["name"]][0] += 1
            stack.append([ts + dur, e, 0.0, dur])
        while stack:
            close(stack.pop())
    return totals, per_range


def range_totals(events, ranges):
    """Device time per named range: {name: [ranges, kernels, device us, {kernel: [n, us]}]}."""
    if not ranges:
        return {}
    owner = {}  # correlation id of a launch -> the innermost range around it
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X":
            corr = (e.get("args") or {}).get("correlation")
            name = ranges.owner(e)
            if corr is not None and name is not None:
                owner[corr] = name
    totals = {}
    for name, (n, _) in ranges.host_totals().items():
        totals[name] = [n, 0, 0.0, collections.defaultdict(lambda: [0, 0.0])]
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


def top(totals, n):
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": k, "count": c, "ms": us / 1e3} for k, (c, us) in rows]


def summary(events, n):
    """Everything the text report prints, as one JSON-ready object."""
    ranges = Ranges(events)
    kernels, busy, span = device_totals(events)
    cpu, cpu_per_range = cpu_self_totals(events, ranges)
    device = range_totals(events, ranges)
    stages = {}
    for name, (count, wall) in ranges.host_totals().items():
        d = device.get(name, [0, 0, 0.0, {}])
        stages[name] = {
            "ranges": count,
            "host_ms": wall / 1e3,
            "cpu_self_ms": sum(us for _, us in cpu_per_range[name].values()) / 1e3,
            "device_ms": d[2] / 1e3,
            "kernels": d[1],
            "top_kernels": top(d[3], n),
            "top_cpu_ops": top(cpu_per_range[name], n),
        }
    return {
        "device_busy_ms": busy / 1e3,
        "device_span_ms": span / 1e3,
        "kernels": top(kernels, n),
        "cpu_ops": top(cpu, n),
        "stages": stages,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Chrome trace JSON file")
    p.add_argument("--top", type=int, default=25, help="rows per table")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f).get("traceEvents", [])
    if args.json:
        print(json.dumps(summary(events, args.top), indent=1))
        return
    ranges = Ranges(events)
    totals, busy, span = device_totals(events)
    if totals:
        print(f"device: busy {busy / 1e3:.3f} ms of {span / 1e3:.3f} ms from the first kernel to the last")
        table("device kernels, copies and fills", totals, args.top, busy)
    cpu, cpu_per_range = cpu_self_totals(events, ranges)
    if ranges:
        per_range = range_totals(events, ranges)
        print("per named range: host (wall) time, CPU operators' self time inside it, and the device time")
        print("of the kernels launched inside it (innermost range; per range: means)")
        print(f"{'ranges':>7} {'host ms':>10} {'per range':>10} {'cpu self':>10} {'kernels':>8} {'device ms':>10} {'per range':>10}  name")
        for name, (n, wall) in sorted(ranges.host_totals().items(), key=lambda kv: -kv[1][1]):
            _, k, us, _ = per_range[name]
            self_ms = sum(t for _, t in cpu_per_range[name].values()) / 1e3
            print(
                f"{n:7d} {wall / 1e3:10.3f} {wall / 1e3 / max(n, 1):10.3f} {self_ms:10.3f} "
                f"{k / max(n, 1):8.1f} {us / 1e3:10.3f} {us / 1e3 / max(n, 1):10.3f}  {name}"
            )
        print()
        for name, (n, _, us, kernels) in sorted(per_range.items(), key=lambda kv: -kv[1][2]):
            if kernels:
                table(f"kernels of the range \"{name}\" ({n} ranges)", kernels, args.top)
        if not totals:
            for name, ops in sorted(cpu_per_range.items(), key=lambda kv: -sum(t for _, t in kv[1].values())):
                table(f"CPU operators of the range \"{name}\", self time", ops, args.top)
    table("CPU operators, self time", cpu, args.top)


if __name__ == "__main__":
    main()
