#!/usr/bin/env python3
"""Side-by-side table of mpipe's benchmark (mpipe_bench --json) and the reference
Python class's (shared/seed/bench_seed.py --json), measured in the same device run.

    python3 bench/compare.py MPIPE_JSON SEED_JSON [SEED_SCALING_JSON] [--transformer=SEED_TRANSFORMER_JSON]

Prints Markdown: per workload, milliseconds (medians) of mpipe, the reference
class, plain LibTorch (C++, the stages one after another; for multi-step rows
the same multi-step stages called once on all T steps) and the CUDA-graph
floors, with the ratios the performance targets are stated in; then the memory
table of a training step under each schedule; then the bf16 rows (mpipe against
plain LibTorch, TFLOP/s and their share of 790) and the transformer beside the
reference class (bench/seed_transformer.py's JSON).
"""
import json
import sys

TARGETS = {  # (workload, kind): (which ratio, bound) -- bench/README.md
    ("narrow-mlp", "forward"): ("speedup_vs_ref", 3.0),
    ("narrow-mlp", "train"): ("speedup_vs_ref", 3.0),
    ("snn-1024", "forward"): ("speedup_vs_ref", 5.0),
    ("snn-256", "forward"): ("speedup_vs_ref", 5.0),
    ("snn-1024", "train"): ("speedup_vs_ref", 3.0),
    ("snn-256", "train"): ("speedup_vs_ref", 3.0),
    ("wide-mlp", "forward"): ("vs_plain", 1.01),
    ("wide-mlp", "train"): ("vs_plain", 1.01),
}


# mpipe's variants of each workload and kind: (row label suffix, mpipe_bench key).
MLP_VARIANTS = {
    "forward": [("", "mpipe_fwd_ms"), (", eager (auto_cuda_graphs off)", "mpipe_eager_fwd_ms"),
                (", cuda_graphs", "mpipe_graph_fwd_ms"),
                (", lanes 2", "mpipe_lanes2_fwd_ms"),
                (", lanes 2 + cuda_graphs", "mpipe_graph_lanes2_fwd_ms")],
    "train": [("", "mpipe_train_ms"), (", cuda_graphs", "mpipe_graph_train_ms")],
}
SNN_VARIANTS = {
    "forward": [(", ATen neurons", "mpipe_aten_constant_fwd_ms"), ("", "mpipe_constant_fwd_ms"),
                (", cuda_graphs", "mpipe_graph_constant_fwd_ms")],
    "train": [(", ATen neurons", "mpipe_aten_constant_train_ms"), ("", "mpipe_constant_train_ms"),
              (", constant_train_step", "mpipe_constant_train_step_ms"),
              (", constant_train_step + cuda_graphs", "mpipe_graph_constant_train_ms")],
}
# Multi-step stages fed time chunks of k steps (T: one chunk); the plain row is
# the same multi-step stages called once on all T steps.
CHUNKS = (1, 2, 4, 8, 32, 64)
for _k in CHUNKS:
    SNN_VARIANTS["forward"].append((f", multi-step, chunk {_k}", f"mpipe_chunk{_k}_constant_fwd_ms"))
    SNN_VARIANTS["train"].append((f", multi-step, chunk {_k}", f"mpipe_chunk{_k}_constant_train_step_ms"))
for _k in (4, 32, 64):
    SNN_VARIANTS["forward"].append((f", multi-step, chunk {_k} + cuda_graphs",
                                    f"mpipe_graph_chunk{_k}_constant_fwd_ms"))
    SNN_VARIANTS["train"].append((f", multi-step, chunk {_k} + cuda_graphs",
                                  f"mpipe_graph_chunk{_k}_constant_train_ms"))
SNN_PLAIN_MULTISTEP = {"forward": "plain_multistep_fwd_ms", "train": "plain_multistep_train_ms"}


def rows(m, s):
    for name in ("narrow-mlp", "wide-mlp", "snn-1024", "snn-256"):
        if name not in m["workloads"] or name not in s:
            continue
        mw, sw = m["workloads"][name], s[name]
        snn = name.startswith("snn")
        for kind in ("forward", "train"):
            if snn:
                ref = sw["seed_constant_fwd_ms" if kind == "forward" else "seed_constant_train_ms"]
                plain = mw["plain_loop_fwd_ms" if kind == "forward" else "plain_loop_train_ms"]
                floor = sw.get("floor_graph_loop_fwd_ms") if kind == "forward" else None
            else:
                ref = sw["seed_fwd_ms" if kind == "forward" else "seed_train_ms"]
                plain = mw["plain_fwd_ms" if kind == "forward" else "plain_train_ms"]
                floor = sw.get("floor_graph_microbatched_fwd_ms") if kind == "forward" else None
            for label, key in (SNN_VARIANTS if snn else MLP_VARIANTS)[kind]:
                if key in mw:
                    # Multi-step rows beside plain LibTorch's multi-step call.
                    p = mw.get(SNN_PLAIN_MULTISTEP[kind], plain) if "multi-step" in label else plain
                    yield name, kind + label, mw[key], ref, p, floor


def failures(m, s):
    """Every variant that reported an error instead of a time: (where, key, message)."""
    out = []
    for source, data in (("mpipe", m.get("workloads", {})), ("reference class", s)):
        for name, w in sorted(data.items()):
            for r in (w if isinstance(w, list) else [w]):
                if not isinstance(r, dict):
                    continue
                for key, value in sorted(r.items()):
                    if key.endswith("_error"):
                        out.append((f"{source} {name}", key[: -len("_error")], str(value)))
    return out


PEAK_TFLOPS = 790  # the H200's bf16 figure (device notes)


def bf16_tables(m, seed_tf):
    w = m.get("workloads", {})
    names = [n for n in ("wide-mlp-bf16", "wide-mlp-bf16-linear", "wide-mlp-bf16w") if n in w]
    if names:
        print()
        print("| bf16 row | mpipe ms | plain LibTorch ms | mpipe / plain | mpipe TFLOP/s | of 790 "
              "| targets (<= 1.01x plain, >= 70 %) met | plain, same micro-batches ms | mpipe / that |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in names:
            r = w[name]
            for kind, pk, variants in (("forward", "plain_fwd_ms", MLP_VARIANTS["forward"]),
                                       ("train", "plain_train_ms", MLP_VARIANTS["train"])):
                for label, mk in variants:
                    if mk not in r or pk not in r:
                        continue
                    ratio, tf = r[mk] / r[pk], r.get(mk[:-3] + "_tflops", 0.0)
                    met = ratio <= 1.01 and tf / PEAK_TFLOPS >= 0.70
                    mb = r.get("plain_microbatch_train_ms") if kind == "train" else None
                    mb_cells = "| |" if mb is None else f"| {mb:.2f} | {r[mk] / mb:.3f} |"
                    print(f"| {name} {kind}{label} | {r[mk]:.2f} | {r[pk]:.2f} | {ratio:.3f} | {tf:.0f} | "
                          f"{100 * tf / PEAK_TFLOPS:.0f} % | {'yes' if met else 'NO'} {mb_cells}")
    t = w.get("transformer")
    if t:
        print()
        print("| transformer training step | ms | TFLOP/s | reference class ms (same micro-batches) "
              "| ref / mpipe |")
        print("|---|---|---|---|---|")
        for key in sorted(k for k in t if k.endswith("_ms")):
            split = key.split("_split")[1].split("_")[0] if "_split" in key else None
            ref = seed_tf.get(f"seed_split{split}_train_ms") if split else seed_tf.get("plain_train_ms")
            cell = "" if ref is None else f"{ref:.1f}"
            ratio = "" if ref is None else f"{ref / t[key]:.2f}x"
            print(f"| {key[:-3]} | {t[key]:.1f} | {t.get(key[:-3] + '_tflops', 0):.0f} | {cell} | {ratio} |")


def main():
    transformer = [a for a in sys.argv[1:] if a.startswith("--transformer=")]
    sys.argv = [a for a in sys.argv if not a.startswith("--transformer=")]
    seed_tf = json.load(open(transformer[0].split("=", 1)[1])) if transformer else {}
    m = json.load(open(sys.argv[1]))
    text = open(sys.argv[2]).read()
    s = json.loads(text) if text.strip() else {}  # /dev/null: no reference figures
    table = list(rows(m, s))
    if table:
        print("| workload | mpipe ms | reference class ms | plain LibTorch ms | CUDA-graph floor ms "
              "| ref / mpipe | mpipe / plain | target | met |")
        print("|---|---|---|---|---|---|---|---|---|")
    for name, kind, mp, ref, plain, floor in table:
        speedup, vs_plain = ref / mp, mp / plain
        which, bound = TARGETS[(name, kind.split(",")[0])]
        if which == "speedup_vs_ref":
            target, met = f">= {bound:g}x faster than ref", speedup >= bound
        else:
            target, met = f"<= {bound:g}x plain", vs_plain <= bound
        print(f"| {name} {kind} | {mp:.2f} | {ref:.2f} | {plain:.2f} | "
              f"{'' if floor is None else f'{floor:.2f}'} | {speedup:.2f}x | {vs_plain:.3f} | "
              f"{target} | {'yes' if met else 'NO'} |")
    scaling = m["workloads"].get("scaling")
    if scaling:
        ref = json.load(open(sys.argv[3])) if len(sys.argv) > 3 else {}
        print()
        print("| wide-mlp train_step, GPipe | GPUs | micro-batches | ms | samples/s | speed-up "
              "| ideal m*n/(m+n-1) | of ideal | reference class ms | ref / mpipe |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in scaling:
            rms = ref.get(f"{r['gpus']}x{r['micro_batches']}")
            ref_ms = "" if rms is None else f"{rms:.1f}"
            ratio = "" if rms is None else f"{rms / r['train_ms']:.2f}x"
            print(f"| | {r['gpus']} | {r['micro_batches']} | {r['train_ms']:.1f} | "
                  f"{r['samples_per_s']:.0f} | {r['speedup']:.2f} | {r['ideal_speedup']:.2f} | "
                  f"{100 * r['efficiency']:.0f} % | {ref_ms} | {ratio} |")
    sched = m["workloads"].get("schedules")
    if sched:
        print()
        print("| training step, schedule | ran | ms | vs GPipe | reference class ms | ref / mpipe "
              "| step's peak above start MiB | bubble measured | bubble predicted |")
        print("|---|---|---|---|---|---|---|---|---|")
        gpipe = {r["workload"]: r.get("train_ms") for r in sched if r["schedule"] == "gpipe"}
        for r in sched:
            ms = r.get("train_ms")
            ref = s.get(r["workload"], {}).get("seed_train_ms")
            g = gpipe.get(r["workload"])
            cell = lambda v, f: "" if v is None else f.format(v)
            print(f"| {r['workload']} {r['schedule']} | {r.get('ran', '')} | {cell(ms, '{:.2f}')} | "
                  f"{cell(ms / g if ms and g else None, '{:.3f}')} | {cell(ref, '{:.2f}')} | "
                  f"{cell(ref / ms if ms and ref else None, '{:.2f}x')} | "
                  f"{cell(r.get('step_peak_above_start_mib'), '{:.0f}')} | "
                  f"{cell(r.get('bubble_measured'), '{:.3f}')} | {cell(r.get('bubble_schedule'), '{:.3f}')} |")
    mem = m["workloads"].get("memory")
    if mem:
        print()
        print("| training step (4 x 2 x Linear(4096), batch 8192, 16 micro-batches) "
              "| peak allocated MiB | before the step MiB | step's peak above that MiB | ms |")
        print("|---|---|---|---|---|")
        for r in mem:
            peaks = ", ".join(f"{d}: {v:.0f}" for d, v in r["peak_allocated_mib"].items())
            above = ", ".join(f"{v:.0f}" for v in r.get("step_peak_above_baseline_mib", {}).values())
            print(f"| {r['mode']} | {peaks} | {r['before_step_mib']:.0f} | {above} | "
                  f"{r['train_ms']:.1f} |")
    bf16_tables(m, seed_tf)
    failed = failures(m, s)
    if failed:
        print()
        print("| variant that failed | key | error |")
        print("|---|---|---|")
        for where, key, message in failed:
            print(f"| {where} | {key} | {message.splitlines()[0][:200] if message else ''} |")
        print(f"compare.py: {len(failed)} variant(s) reported an error instead of a time",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
