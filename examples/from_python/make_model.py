#!/usr/bin/env python3
"""The Python side of examples/from_python (see README.md).

    python3 make_model.py save  --out model.pt         # script an MLP classifier and save it
    python3 make_model.py check --model finetuned.pt   # load what the C++ program saved back
                                [--data DIR]           #   and print its test accuracy

`save` writes torch.jit.script(model) for the C++ program's --model. The model is an
nn.Sequential with named children, the same layers the C++ program builds when it is given
no --model. `check` loads the fine-tuned module with torch.jit.load and prints its accuracy
on Fashion-MNIST's test set, computed here in Python: the number the C++ program printed.
"""
import argparse
import gzip
import os
from collections import OrderedDict

import torch
from torch import nn


def mlp_classifier():
    """Flatten, three hidden Linear+ReLU layers, and a head: 8 children to split."""
    return nn.Sequential(OrderedDict([
        ("flatten", nn.Flatten()),
        ("fc0", nn.Linear(28 * 28, 256)), ("act0", nn.ReLU()),
        ("fc1", nn.Linear(256, 256)), ("act1", nn.ReLU()),
        ("fc2", nn.Linear(256, 128)), ("act2", nn.ReLU()),
        ("head", nn.Linear(128, 10)),
    ]))


def read_idx(path):
    """An IDX file (gzipped or not) as a uint8 tensor of its shape."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * k:8 + 4 * k], "big") for k in range(dims)]
    return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def test_set(data_dir):
    def find(stem):
        for name in (stem + ".gz", stem):
            if os.path.exists(os.path.join(data_dir, name)):
                return os.path.join(data_dir, name)
        raise SystemExit(f"{stem}(.gz) not found in {data_dir}")
    images = read_idx(find("t10k-images-idx3-ubyte")).float().div(255).unsqueeze(1)
    labels = read_idx(find("t10k-labels-idx1-ubyte")).long()
    return images, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="script the model and save it")
    save.add_argument("--out", default="model.pt")
    save.add_argument("--seed", type=int, default=0)
    check = sub.add_parser("check", help="load the C++ program's fine-tuned module")
    check.add_argument("--model", default="finetuned.pt")
    check.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    args = parser.parse_args()
    if args.command == "save":
        torch.manual_seed(args.seed)
        scripted = torch.jit.script(mlp_classifier())
        scripted.save(args.out)
        print(f"saved {args.out}: {sum(p.numel() for p in scripted.parameters())} parameters, "
              f"children {', '.join(name for name, _ in scripted.named_children())}")
        return
    model = torch.jit.load(args.model, map_location="cpu").eval()
    images, labels = test_set(args.data)
    with torch.no_grad():
        correct = sum(int(model(images[k:k + 1000]).argmax(1).eq(labels[k:k + 1000]).sum())
                      for k in range(0, len(labels), 1000))
    print(f"{args.model} loaded in Python: test accuracy {100 * correct / len(labels):.2f}%")


if __name__ == "__main__":
    main()
