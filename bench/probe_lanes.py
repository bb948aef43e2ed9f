#!/usr/bin/env python3
"""Probe: how much faster narrow-mlp's micro-batched forward runs on the GPU
when each stage spreads its micro-batches over k streams ("lanes") instead of
one, replayed from a CUDA graph (no host cost). Decides whether per-stage
lanes are worth building (issue 15).

    python3 bench/probe_lanes.py [--reps N]
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    stages = [nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())]).to(dev)
              for _ in range(4)]
    x = torch.randn(512, 1024, device=dev)
    chunks = x.split(64)
    m, n = len(chunks), len(stages)

    def pipelined(lanes):
        streams = [[torch.cuda.Stream() for _ in range(lanes)] for _ in range(n)]

        def run():
            start = torch.cuda.current_stream()
            for row in streams:
                for s in row:
                    s.wait_stream(start)
            outs = []
            done = [[None] * m for _ in range(n)]
            for i, c in enumerate(chunks):  # issue order: micro-batch by micro-batch
                h = c
                for j in range(n):
                    s = streams[j][i % lanes]
                    if j > 0:
                        s.wait_event(done[j - 1][i])
                    with torch.cuda.stream(s):
                        h = stages[j](h)
                        e = torch.cuda.Event()
                        e.record(s)
                        done[j][i] = e
                outs.append(h)
            for row in streams:
                for s in row:
                    start.wait_stream(s)
            return torch.cat(outs)
        return run

    with torch.no_grad():
        ref = torch.cat([stages[3](stages[2](stages[1](stages[0](c)))) for c in chunks])
        for lanes in (1, 2, 4, 8):
            fn = pipelined(lanes)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fn()
            g.replay()
            torch.cuda.synchronize()
            diff = (out - ref).abs().max().item()  # cuBLAS may pick other kernels per stream
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t0) * 1e3)
            eager = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                eager.append((time.perf_counter() - t0) * 1e3)
            print(f"lanes {lanes}: graphed {statistics.median(ts):.2f} ms, "
                  f"eager (Python) {statistics.median(eager):.2f} ms, max |diff| {diff:.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
