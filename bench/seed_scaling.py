"""The reference Python ModelPipeline on wide-mlp's training step with stage s on
cuda:(s * g // 4) for g = 1, 2, 4 GPUs (as many as there are) and 8 and 32
micro-batches: the same placement and workload as `mpipe_bench --only scaling`.

    python3 bench/seed_scaling.py SEED_DIR [--json FILE] [--reps N]

SEED_DIR holds model_pipeline.py (shared/seed, or .devdata/seed on the GPU
machine). Prints and writes {"GxM": milliseconds}, medians of --reps runs after
3 warm-ups, each closed by synchronising every GPU.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn as nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("seed_dir")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    sys.path.insert(0, a.seed_dir)
    from model_pipeline import ModelPipeline  # noqa: E402

    torch.backends.cuda.matmul.allow_tf32 = False
    gpus = torch.cuda.device_count()
    width, batch, out = 8192, 8192, {}

    def sync():
        for d in range(gpus):
            torch.cuda.synchronize(d)

    for g in (1, 2, 4):
        if g > gpus:
            break
        for m in (8, 32):
            torch.manual_seed(0)
            pipe = ModelPipeline()
            for s in range(4):
                stage = nn.Sequential(*[mod for _ in range(2)
                                        for mod in (nn.Linear(width, width), nn.ReLU())])
                pipe.append(stage, str(s * g // 4))
            x = torch.randn(batch, width, device="cuda:0")

            def step():
                pipe.zero_grad(set_to_none=True)
                pipe(x, batch // m).pow(2).mean().backward()

            for _ in range(3):
                step()
            sync()
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                step()
                sync()
                ts.append(time.perf_counter() - t0)
            out[f"{g}x{m}"] = statistics.median(ts) * 1e3
            print(f"reference class, {g} GPU(s), {m} micro-batches: {out[f'{g}x{m}']:.1f} ms",
                  flush=True)
            del pipe, x
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
