#!/usr/bin/env python3
"""Check that a memfit export loads into torchvision, strictly.

Usage:
    python tools/check_export.py FILE MODEL [--num-classes N]

FILE is a safetensors file written by memfit (`memfit::io::save_state_dict`),
MODEL a torchvision model constructor name (resnet18 ... resnet152). The script
builds `torchvision.models.<MODEL>(num_classes=N)` -- N defaults to the rows of
the file's `fc.weight` -- and calls
`model.load_state_dict(safetensors.torch.load_file(FILE), strict=True)`.
It also checks that every tensor keeps its dtype and shape (float32 weights and
running statistics, int64 0-d `num_batches_tracked`, as `torch.save` writes
them), runs one eval-mode forward to show the model is usable, and prints OK.
Exit status 0 on success, 1 with the reason otherwise.

How to produce the files (see tests/io.rs):
    cargo test --test io -- --ignored
    /tmp/torchvenv/bin/python tools/check_export.py /tmp/memfit_resnet50.safetensors resnet50
    /tmp/torchvenv/bin/python tools/check_export.py /tmp/memfit_resnet18_7cls.safetensors resnet18

Needs torch, torchvision and safetensors (e.g. the venv in tests/fixtures/README.md).
"""

import argparse
import json
import struct
import sys


def header_metadata(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__", {})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("model", help="torchvision constructor, e.g. resnet50")
    ap.add_argument("--num-classes", type=int, default=None)
    args = ap.parse_args()

    import torch
    import torchvision
    from safetensors.torch import load_file

    sd = load_file(args.file)
    if "fc.weight" not in sd and args.num_classes is None:
        sys.exit(f"{args.file}: no fc.weight; pass --num-classes")
    num_classes = args.num_classes or sd["fc.weight"].shape[0]
    ctor = getattr(torchvision.models, args.model, None)
    if ctor is None:
        sys.exit(f"torchvision.models has no '{args.model}'")
    model = ctor(num_classes=num_classes)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        sys.exit(f"{args.file}: strict load into {args.model} failed:\n{e}")

    # load_state_dict copies into the model's tensors, so dtype/shape must be
    # compared against torch's own state_dict explicitly.
    ref = model.state_dict()
    bad = [
        f"{k}: file {tuple(v.shape)} {v.dtype}, torch {tuple(ref[k].shape)} {ref[k].dtype}"
        for k, v in sd.items()
        if v.dtype != ref[k].dtype or v.shape != ref[k].shape
    ]
    if bad:
        sys.exit(f"{args.file}: dtype/shape differ from torch's state_dict:\n  " + "\n  ".join(bad))
    for k, v in ref.items():
        if not torch.equal(v, sd[k]):
            sys.exit(f"{args.file}: '{k}' changed on load")

    model.eval()
    with torch.no_grad():
        y = model(torch.randn(1, 3, 64, 64))
    if not torch.isfinite(y).all():
        sys.exit(f"{args.file}: non-finite logits")

    params = sum(p.numel() for p in model.parameters())
    meta = header_metadata(args.file)
    print(
        f"OK: {args.file} loads strictly into torchvision.models.{args.model}"
        f"(num_classes={num_classes}): {len(sd)} tensors, {params} parameters, "
        f"logits {tuple(y.shape)}, metadata {meta} "
        f"(torch {torch.__version__}, torchvision {torchvision.__version__})"
    )


if __name__ == "__main__":
    main()
