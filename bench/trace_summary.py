#!/usr/bin/env python3
"""Summarises the Chrome traces `mpipe_bench --profile DIR` writes: where one
call's time goes, on the GPU (kernels, streams) and on each host thread.

    python3 bench/trace_summary.py DIR_OR_FILES... [--top N]

Per trace: the call's span; the GPU's busy time (union of kernel intervals),
per stream, and the kernels that took the most time; per host thread, its busy
time (union of its top-level ops), kernel launches, and the top-level ops that
took the most time (the autograd engine's thread shows as
`autograd::engine::evaluate_function: ...`), and its CUDA runtime and driver
calls by total time ([api]: the same call taking longer on threads that
launch at once shows their contention for the driver).
"""
import argparse
import collections
import glob
import gzip
import json
import os


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def union(intervals):
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def top_level(events):
    """The events of one thread not nested in another one."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def summarise(path, top):
    events = [e for e in load(path).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    for e in events:
        e["ts"], e["dur"] = float(e["ts"]), float(e["dur"])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime",
                                                 "cuda_driver")]
    if not events:
        print(f"{path}: no events")
        return
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    print(f"== {os.path.basename(path)}: span {(t1 - t0) / 1000:.2f} ms, "
          f"{len(kernels)} kernels, {len(cpu)} host events")
    if kernels:
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        ksum = sum(e["dur"] for e in kernels)
        print(f"  GPU busy {busy / 1000:.2f} ms ({100 * busy / (t1 - t0):.0f} % of the span), "
              f"kernel time summed {ksum / 1000:.2f} ms")
        streams = collections.defaultdict(list)
        for e in kernels:
            streams[e.get("args", {}).get("stream", e.get("tid"))].append(e)
        for s, ks in sorted(streams.items(), key=lambda kv: str(kv[0])):
            b = union([(e["ts"], e["ts"] + e["dur"]) for e in ks])
            print(f"    stream {s}: {len(ks)} kernels, busy {b / 1000:.2f} ms")
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for e in kernels:
            v = by_name[e["name"][:90]]
            v[0] += 1
            v[1] += e["dur"]
        print("  kernels by total time:")
        for name, (n, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"    {d / 1000:8.2f} ms  {n:5d} x {d / n:7.1f} us  {name}")
    threads = collections.defaultdict(list)
    for e in cpu:
        threads[e.get("tid")].append(e)
    for tid, evs in sorted(threads.items(), key=lambda kv: -len(kv[1])):
        ops = [e for e in evs if e.get("cat") in ("cpu_op", "user_annotation")]
        launches = sum(1 for e in evs if e.get("cat") == "cuda_runtime"
                       and "Launch" in e.get("name", ""))
        syncs = [e for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver")
                 and "Synchronize" in e.get("name", "")]
        tl = top_level(ops)
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in tl])
        sync_ms = sum(e["dur"] for e in syncs) / 1000
        print(f"  thread {tid}: {len(ops)} ops, busy {busy / 1000:.2f} ms, {launches} launches, "
              f"{len(syncs)} synchronizes ({sync_ms:.2f} ms)")
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for e in tl:
            v = by_name[e["name"][:80]]
            v[0] += 1
            v[1] += e["dur"]
        for name, (n, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"      {d / 1000:8.2f} ms  {n:5d} x {d / n:7.1f} us  {name}")
        # CUDA runtime and driver calls (nested in the ops above): where
        # threads contend for the driver, the same call takes longer.
        api = collections.defaultdict(lambda: [0, 0.0])
        for e in evs:
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                v = api[e["name"][:60]]
                v[0] += 1
                v[1] += e["dur"]
        for name, (n, d) in sorted(api.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"      {d / 1000:8.2f} ms  {n:5d} x {d / n:7.1f} us  [api] {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    files = []
    for p in args.paths:
        files += sorted(glob.glob(os.path.join(p, "*.json*"))) if os.path.isdir(p) else [p]
    for f in files:
        summarise(f, args.top)


if __name__ == "__main__":
    main()
