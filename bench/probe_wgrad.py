#!/usr/bin/env python3
"""Probe: what micro-batching costs a bf16 training step of wide-mlp (8 x
Linear(8192) + ReLU, batch 8192) on one GPU, and which way of producing the
weight gradients wins it back. No pipeline, no threads: one stream, so only
the arithmetic and memory traffic differ. Decides how mpipe::Linear makes its
weight gradients (issue 15).

    python3 bench/probe_wgrad.py [--reps N]

Rows (each: forward, loss y.pow(2).mean(), backward, per step):
  whole      one batch of 8192 (plain autocast: the target)
  micro      8 micro-batches of 1024, autograd as is (what mpipe runs now)
  fused_add  8 micro-batches; a custom Linear whose backward adds its bf16
             weight gradient into the fp32 .grad in one kernel (no conversion)
  addmm      8 micro-batches; the weight-gradient GEMM accumulates into the
             .grad itself (addmm_, out_dtype where the weight is fp32)
  deferred   8 micro-batches; backward keeps (grad_out, input) and one GEMM
             over all micro-batches makes each weight gradient at the end
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

W, B, MB, L = 8192, 8192, 1024, 8


class Lin(torch.autograd.Function):
    mode = "fused_add"
    stash = {}

    @staticmethod
    def forward(ctx, x, w, w16):
        ctx.save_for_backward(x, w16)
        ctx.w = w
        return x @ w16.t()

    @staticmethod
    def backward(ctx, g):
        x, w16 = ctx.saved_tensors
        w = ctx.w
        gx = g @ w16
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if Lin.mode == "fused_add":
            gw = g2.t() @ x2
            if w.grad is None:
                w.grad = gw.to(w.dtype)
            else:
                w.grad.add_(gw)
        elif Lin.mode == "addmm":
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            if w.dtype == g.dtype:
                w.grad.addmm_(g2.t(), x2)
            else:
                torch.addmm(w.grad, g2.t(), x2, out_dtype=w.dtype, out=w.grad)
        else:  # deferred
            Lin.stash.setdefault(id(w), (w, []))[1].append((g2, x2))
        return gx, None, None


def flush():
    for w, pairs in Lin.stash.values():
        g = torch.cat([p[0] for p in pairs])
        x = torch.cat([p[1] for p in pairs])
        gw = g.t() @ x
        if w.grad is None:
            w.grad = gw.to(w.dtype)
        else:
            w.grad.add_(gw)
    Lin.stash.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    x = torch.randn(B, W, device=dev)
    print(torch.__version__, torch.cuda.get_device_name(0))
    for wdtype in (torch.float32, torch.bfloat16):
        ws = [(torch.randn(W, W, device=dev) / W ** 0.5).to(wdtype).requires_grad_() for _ in range(L)]
        bs = [torch.zeros(W, device=dev, dtype=wdtype, requires_grad=True) for _ in range(L)]
        xin = x.to(wdtype)

        def step(mode):
            for p in ws + bs:
                p.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if mode == "whole":
                    y = xin
                    for w, b in zip(ws, bs):
                        y = F.relu(F.linear(y, w, b))
                    y.float().pow(2).mean().backward()
                    return
                chunks = xin.split(MB)
                w16 = [w.detach().to(torch.bfloat16) for w in ws] if mode != "micro" else None
                Lin.mode = mode
                for c in chunks:
                    y = c
                    for i, (w, b) in enumerate(zip(ws, bs)):
                        if mode == "micro":
                            y = F.relu(F.linear(y, w, b))
                        else:
                            y = F.relu(Lin.apply(y.to(torch.bfloat16), w, w16[i]) + b)
                    (y.float().pow(2).sum() / (B * W)).backward()
                if mode == "deferred":
                    flush()

        ref = None
        for mode in ("whole", "micro", "fused_add", "addmm", "deferred"):
            try:
                for _ in range(2):
                    step(mode)
                torch.cuda.synchronize()
                g = ws[0].grad.float().clone()
                times = []
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    step(mode)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t) * 1e3)
                med = statistics.median(times)
                if ref is None:
                    ref, gref = med, g
                err = ((g - gref).norm() / gref.norm()).item()
                print(f"weights {str(wdtype):15s} {mode:10s} {med:8.2f} ms  {med / ref:5.3f}x whole"
                      f"  grad rel err vs whole {err:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"weights {str(wdtype):15s} {mode:10s} failed: {str(e).splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
