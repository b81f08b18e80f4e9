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
before/after comparison). --gaps adds where the device sat idle (a trace of several host
threads, as `bench --trace-pipeline FILE` writes): each gap of at least --gap-us between device
work, whether the work that ended it was launched before the gap began or only during it (the
device waited for that thread's launch), and what every host thread was doing in the CUDA
runtime meanwhile (synchronisations, allocations, launches). Standard library only, so that it
runs where the trace was made and only its summary has to travel.

  python3 tools/trace_summary.py TRACE.json [--top 25] [--json] [--gaps [--gap-us 20]]
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


RUNTIME = ("cuda_runtime", "cuda_driver")


def thread_names(events):
    """{(pid, tid): name} from the trace's thread_name metadata."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = (e.get("args") or {}).get("name", "")
    return names


def device_gaps(events, min_us):
    """The device's idle gaps of at least `min_us`: [(start, end, first event after)]."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), i)
        for i, e in enumerate(events)
        if e.get("cat") in DEVICE and e.get("ph") == "X"
    )
    gaps, end = [], None
    for s, f, i in spans:
        if end is not None and s - end >= min_us:
            gaps.append((end, s, events[i]))
        end = f if end is None else max(end, f)
    return gaps


def gap_report(events, min_us):
    """Where the device's idle time goes: {"gaps", "idle_ms", "by_size", "ended_by",
    "runtime_during"} (see the module's docstring)."""
    names = thread_names(events)

    def thread(e):
        key = (e.get("pid"), e.get("tid"))
        return f"{names.get(key) or 'thread'} {key[1]}"

    launches = {}
    calls = collections.defaultdict(list)  # thread -> [(start, end, name)]
    for e in events:
        if e.get("cat") in RUNTIME and e.get("ph") == "X":
            ts = float(e["ts"])
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (ts, thread(e))
            calls[thread(e)].append((ts, ts + float(e.get("dur", 0)), e.get("name", "?")))
    # device time by the thread that launched the work, and how often the device switched
    # from one launching thread's work to another's
    by_thread = collections.defaultdict(float)
    switches, last = 0, None
    for e in sorted(
        (e for e in events if e.get("cat") in DEVICE and e.get("ph") == "X"),
        key=lambda e: float(e["ts"]),
    ):
        launch = launches.get((e.get("args") or {}).get("correlation"))
        who = launch[1] if launch else "no launch recorded"
        by_thread[who] += float(e.get("dur", 0))
        switches += last is not None and who != last
        last = who
    gaps = device_gaps(events, min_us)
    by_size = collections.Counter()
    ended_by = collections.defaultdict(lambda: [0, 0.0])
    during = collections.defaultdict(lambda: [0, 0.0])
    for g0, g1, nxt in gaps:
        us = g1 - g0
        bucket = next(b for b in (50, 200, 1000, 5000, float("inf")) if us < b)
        by_size[f"< {bucket:g} us" if bucket != float("inf") else ">= 5000 us"] += 1
        launch = launches.get((nxt.get("args") or {}).get("correlation"))
        if launch is None:
            key = "no launch recorded"
        elif launch[0] > g0:
            key = f"launched during the gap by {launch[1]}"
        else:
            key = f"launched before the gap by {launch[1]}"
        ended_by[key][0] += 1
        ended_by[key][1] += us
        for th, cs in calls.items():
            for c0, c1, name in cs:
                overlap = min(c1, g1) - max(c0, g0)
                if overlap > 0:
                    t = during[f"{th}: {name}"]
                    t[0] += 1
                    t[1] += overlap
    return {
        "gaps": len(gaps),
        "idle_ms": sum(g1 - g0 for g0, g1, _ in gaps) / 1e3,
        "by_size": dict(by_size),
        "ended_by": {k: {"gaps": n, "ms": us / 1e3} for k, (n, us) in ended_by.items()},
        "runtime_during": top(during, 40),
        "device_ms_by_thread": {k: us / 1e3 for k, us in by_thread.items()},
        "thread_switches": switches,
    }


def print_gaps(report, min_us, n):
    print(f"device idle gaps of at least {min_us:g} us: {report['gaps']}, {report['idle_ms']:.3f} ms in all")
    print("  by length: " + ", ".join(f"{k}: {v}" for k, v in sorted(report["by_size"].items())))
    print("  the work that ended each gap:")
    for k, v in sorted(report["ended_by"].items(), key=lambda kv: -kv[1]["ms"]):
        print(f"  {v['gaps']:8d} {v['ms']:10.3f} ms  {k}")
    print(f"  device time by the thread that launched it ({report['thread_switches']} switches between threads):")
    for k, ms in sorted(report["device_ms_by_thread"].items(), key=lambda kv: -kv[1]):
        print(f"  {ms:10.3f} ms  {k}")
    print("  CUDA runtime calls of each thread during the gaps (time inside the gaps):")
    for r in report["runtime_during"][:n]:
        print(f"  {r['count']:8d} {r['ms']:10.3f} ms  {r['name']}")
    print()


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
    p.add_argument("--gaps", action="store_true", help="also where the device sat idle")
    p.add_argument("--gap-us", type=float, default=20.0, help="shortest gap counted (us)")
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f).get("traceEvents", [])
    if args.json:
        out = summary(events, args.top)
        if args.gaps:
            out["gaps"] = gap_report(events, args.gap_us)
        print(json.dumps(out, indent=1))
        return
    if args.gaps:
        print_gaps(gap_report(events, args.gap_us), args.gap_us, args.top)
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
