#!/usr/bin/env python3
"""Writes the AOTInductor packages that ExportedStages' tests load (tests/test_script.cpp):
front.pt2 and back.pt2, the two halves of a small MLP exported with a dynamic batch dimension
and compiled for the device named by the second argument (default cuda).

    python3 tests/export_packages.py DIR [cuda|cpu]
"""
import os
import sys

import torch


def main():
    out = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 16)).to(device).eval()
    for name, part, width in (("front", model[:3], 32), ("back", model[3:], 64)):
        x = torch.randn(8, width, device=device)
        try:  # every micro-batch size; a torch that specialises sizes 0 and 1 refuses min=1
            program = torch.export.export(
                part, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4096)},))
        except Exception:  # noqa: BLE001 (any refusal: the tests use micro-batches of 6 or more rows)
            program = torch.export.export(
                part, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=4096)},))
        torch._inductor.aoti_compile_and_package(program,
                                                 package_path=os.path.join(out, name + ".pt2"))
    print("wrote", os.path.join(out, "front.pt2"), "and back.pt2")


if __name__ == "__main__":
    main()
