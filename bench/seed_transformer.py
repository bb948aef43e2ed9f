"""The transformer workload (8 pre-norm blocks of width 4096, 32 heads, sequence
2048, batch 8, 4 stages of 2 blocks on cuda:0, bf16 autocast over fp32
weights, loss mean(y^2)) as plain PyTorch and through the reference Python
ModelPipeline with micro-batches of 1 and 2 sequences: the same workload as
`mpipe_bench --only transformer`.

    python3 bench/seed_transformer.py SEED_DIR [--json FILE] [--reps N]

SEED_DIR holds model_pipeline.py (shared/seed, or .devdata/seed on the GPU
machine). Prints and writes milliseconds, medians of --reps runs after 3
warm-ups, each closed by torch.cuda.synchronize(), with TFLOP/s counted as
mpipe_bench counts them.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("seed_dir")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="a tiny form, to check the script")
    a = ap.parse_args()
    sys.path.insert(0, a.seed_dir)
    from model_pipeline import ModelPipeline  # noqa: E402

    d, heads, seq, batch = (64, 4, 32, 4) if a.small else (4096, 32, 2048, 8)
    torch.manual_seed(0)
    stages = [nn.Sequential(Block(d, heads), Block(d, heads)) for _ in range(4)]
    pipe = ModelPipeline()
    for s in stages:
        pipe.append(s, "0")
    x = torch.randn(batch, seq, d, device="cuda:0")

    def timeit(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    def plain():
        pipe.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x
            for s in stages:
                y = s(y)
            loss = y.pow(2).mean()
        loss.backward()

    def seed(split):
        def step():
            pipe.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = pipe(x, split).pow(2).mean()
            loss.backward()
        return step

    out = {"plain_train_ms": timeit(plain)}
    for split in (1, 2):
        out[f"seed_split{split}_train_ms"] = timeit(seed(split))
    fwd = 8.0 * batch * seq * (24.0 * d * d + 4.0 * seq * d)
    for k in list(out):
        out[k[:-3] + "_tflops"] = 3 * fwd / (out[k] * 1e-3) / 1e12
    out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print("transformer (reference class)", json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
