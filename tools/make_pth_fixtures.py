#!/usr/bin/env python3
"""Generate the torch.save fixtures in tests/fixtures/pth/ (tests/pth.rs).

memfit reads torchvision's `.pth` weight files (torch.save archives) with a
restricted unpickler (src/io/pth.rs). The files here are written by torch.save
itself, next to safetensors twins holding the same tensors, so the tests can
check the .pth load is bit-identical; plus hand-written hostile and broken
files. The fixtures are committed; this script is only needed to regenerate
them. It does not install anything.

How to run (from the repository root), with a Python environment that has
torch, torchvision and safetensors, e.g. a throw-away venv:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch torchvision safetensors numpy
    /tmp/torchvenv/bin/python tools/make_pth_fixtures.py

Afterwards, when the memfit binary is built (`cargo build`; its path is taken
from $MEMFIT, else $CARGO_TARGET_DIR/debug/memfit, else target/debug/memfit),
the script also saves a full-size torchvision ResNet-50 (random init,
`torchvision.models.resnet50()`, about 100 MB, written to a temporary folder
and not committed) with torch.save, in both formats, and checks that
`memfit eval --weights` and `memfit train --init ... --reset-head` load it.

tests/fixtures/pth/README.md is regenerated alongside the fixtures, with the
torch and torchvision versions that wrote them.
"""

import io
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile

import torch
import torchvision
from safetensors.torch import save_file
from torchvision.models.resnet import BasicBlock, Bottleneck

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import ResNet  # noqa: E402  (torchvision's ResNet, base width a parameter)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "pth")
# What the hostile fixture would run if it were unpickled by Python.
EXECUTED_MARKER = "/tmp/memfit-pth-fixture-executed"

written = []  # (file name, description) for the README


def path(name):
    return os.path.join(OUT, name)


def note(name, description):
    written.append((name, os.path.getsize(path(name)), description))


def randomise_bn(model, seed, batches_tracked):
    """BN weights, biases and running stats away from their init, so a test
    that swapped two of them would notice; num_batches_tracked set."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.num_batches_tracked.fill_(batches_tracked)


def twin(name, sd):
    """The same tensors as safetensors (contiguous copies)."""
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, path(name),
              metadata={"torch_version": torch.__version__,
                        "torchvision_version": torchvision.__version__,
                        "generator": "tools/make_pth_fixtures.py"})


def make_resnets():
    # (a) a bottleneck ResNet: memfit's --model resnet50 --base-width 2
    # (torchvision's layers [3,4,6,3], ImageNet stem), 10 classes.
    torch.manual_seed(5000)
    m = ResNet(Bottleneck, [3, 4, 6, 3], num_classes=10, base=2)
    randomise_bn(m, 5001, 7)
    sd = m.state_dict()
    torch.save(sd, path("resnet50_w2.pth"))
    twin("resnet50_w2.safetensors", sd)
    note("resnet50_w2.pth", "torch.save(model.state_dict()) of a ResNet-50 with base width 2 "
         "(torchvision layers [3,4,6,3], Bottleneck, ImageNet stem, 10 classes, seed 5000; "
         "BN params and stats randomised, num_batches_tracked = 7): memfit's "
         "`--model resnet50 --base-width 2 --classes 10`.")
    note("resnet50_w2.safetensors", "the same tensors as resnet50_w2.pth (safetensors).")

    # (b) a basic-block ResNet whose BN counted real batches: three
    # train-mode forwards, so num_batches_tracked (I64 scalars) is 3.
    torch.manual_seed(5100)
    m = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=10, base=2)
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(4, 3, 32, 32))
    sd = m.state_dict()
    assert int(sd["bn1.num_batches_tracked"]) == 3
    torch.save(sd, path("resnet18_w2.pth"))
    # (e) the same state_dict in the legacy (torch < 1.6) format.
    torch.save(sd, path("resnet18_w2_legacy.pth"), _use_new_zipfile_serialization=False)
    twin("resnet18_w2.safetensors", sd)
    note("resnet18_w2.pth", "torch.save(model.state_dict()) of a ResNet-18 with base width 2 "
         "(BasicBlock [2,2,2,2], ImageNet stem, 10 classes, seed 5100) after three train-mode "
         "forwards: running stats moved, num_batches_tracked = 3 (I64 0-d tensors).")
    note("resnet18_w2_legacy.pth", "the same state_dict saved with "
         "`_use_new_zipfile_serialization=False` (legacy torch < 1.6 format: pickles then "
         "raw storages, no zip).")
    note("resnet18_w2.safetensors", "the same tensors as resnet18_w2.pth (safetensors).")


def make_mixed():
    """Dtypes other than f32/i64 (converted to f32 by memfit) and views."""
    torch.manual_seed(5200)
    base = torch.randn(5, 4)
    sd = {
        "half": torch.randn(3, 2).half(),
        "bf16": torch.randn(3, 2).bfloat16(),
        "double": torch.randn(2, 3, dtype=torch.float64),
        "long": torch.arange(-3, 4, dtype=torch.int64),
        "scalar": torch.tensor(42, dtype=torch.int64),
        "base": base,
        # Views share base's storage: a transpose (strides (1, 4)) and rows
        # 2..4 (storage offset 8).
        "transposed": base.t(),
        "rows": base[2:4],
        "empty": torch.zeros(0, 3),
    }
    torch.save(sd, path("mixed.pth"))
    expected = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    twin("mixed.safetensors", expected)
    note("mixed.pth", "f16, bf16 and f64 tensors, i64 vector and 0-d scalar, a tensor and two "
         "strided views of its storage (a transpose, a row slice with offset), an empty tensor.")
    note("mixed.safetensors", "mixed.pth's tensors as memfit reads them: floats converted to "
         "f32, views made contiguous.")

    raw = open(path("mixed.pth"), "rb").read()
    open(path("truncated.pth"), "wb").write(raw[: len(raw) * 2 // 3])
    note("truncated.pth", "the first two thirds of mixed.pth (a zip without its central "
         "directory).")


def torch_like_zip(name, pickle_bytes):
    """A zip laid out as torch.save writes it (stored entries under one
    folder), holding `pickle_bytes` as data.pkl."""
    folder = os.path.splitext(name)[0]
    with zipfile.ZipFile(path(name), "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{folder}/data.pkl", pickle_bytes)
        z.writestr(f"{folder}/byteorder", "little")
        z.writestr(f"{folder}/data/0", b"\0" * 16)
        z.writestr(f"{folder}/version", "3\n")


def make_hostile():
    # (c) os.system in the pickle, written opcode by opcode (nothing real is
    # pickled): an OrderedDict whose 'conv1.weight' would be the result of
    # os.system('touch <marker>') if Python unpickled it.
    def unicode(s):
        b = s.encode()
        return b"X" + len(b).to_bytes(4, "little") + b

    pkl = (
        b"\x80\x02"                           # PROTO 2
        b"ccollections\nOrderedDict\n"        # GLOBAL collections.OrderedDict
        b")R"                                 # EMPTY_TUPLE, REDUCE -> {}
        b"("                                  # MARK
        + unicode("conv1.weight")
        + b"cos\nsystem\n"                    # GLOBAL os.system
        + unicode(f"touch {EXECUTED_MARKER}")
        + b"\x85R"                            # TUPLE1, REDUCE -> os.system(...)
        b"u."                                 # SETITEMS, STOP
    )
    torch_like_zip("foreign_global.pth", pkl)
    note("foreign_global.pth", "a torch.save-style zip whose data.pkl (hand-written opcodes) "
         f"calls os.system('touch {EXECUTED_MARKER}') as the value of 'conv1.weight'. "
         "Refused, naming os.system; nothing runs.")

    # A whole module saved with torch.save(model): the pickle names its class.
    torch.manual_seed(5300)
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), path("whole_model.pth"))
    note("whole_model.pth", "torch.save(model) of nn.Sequential(nn.Linear(2, 2)), not a "
         "state_dict: the pickle names torch.nn.modules.container.Sequential. Refused.")

    # A training checkpoint: a dict of dicts, not a state_dict.
    torch.save({"epoch": 3, "model": {"w": torch.zeros(2)}}, path("checkpoint_dict.pth"))
    note("checkpoint_dict.pth", "torch.save({'epoch': 3, 'model': {...}}): a checkpoint "
         "dict, not a state_dict. Refused with a hint.")


def write_readme():
    lines = [
        "# torch.save fixtures",
        "",
        "Generated by `tools/make_pth_fixtures.py` (do not edit by hand); tested by",
        "`tests/pth.rs`. Regenerate from the repository root with a Python environment",
        "that has torch, torchvision and safetensors (see the script's docstring).",
        "",
        f"Generated with torch `{torch.__version__}`, torchvision `{torchvision.__version__}`, "
        f"Python `{platform.python_version()}`, on CPU.",
        "",
        "| file | bytes | what |",
        "|---|---|---|",
    ]
    for name, size, desc in written:
        lines.append(f"| `{name}` | {size} | {desc} |")
    lines.append("")
    with open(path("README.md"), "w") as f:
        f.write("\n".join(lines))


def memfit_binary():
    if os.environ.get("MEMFIT"):
        return os.environ["MEMFIT"]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    return os.path.join(target, "debug", "memfit")


def check_full_resnet50():
    """A full-size torchvision ResNet-50 saved by torch.save loads in memfit."""
    exe = memfit_binary()
    if not os.path.exists(exe):
        print(f"ResNet-50 check skipped: no memfit binary at {exe} (cargo build first)")
        return True
    tmp = tempfile.mkdtemp(prefix="memfit-pth-r50-")
    ok = True
    try:
        torch.manual_seed(0)
        m = torchvision.models.resnet50()
        files = {
            "zip": os.path.join(tmp, "resnet50.pth"),
            "legacy": os.path.join(tmp, "resnet50_legacy.pth"),
        }
        torch.save(m.state_dict(), files["zip"])
        torch.save(m.state_dict(), files["legacy"], _use_new_zipfile_serialization=False)
        data = ["--data", "synthetic", "--image-size", "32", "--batch-size", "2",
                "--train-size", "4", "--val-size", "2"]
        for kind, f in files.items():
            runs = [
                ["eval", "--weights", f, "--model", "resnet50", "--classes", "1000"] + data,
                ["train", "--init", f, "--reset-head", "--model", "resnet50", "--steps", "1"]
                + data,
            ]
            for args in runs:
                r = subprocess.run([exe] + args, capture_output=True, text=True)
                status = "ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})"
                print(f"ResNet-50 ({kind}, {os.path.getsize(f)} bytes): memfit {args[0]}: {status}")
                if r.returncode != 0:
                    ok = False
                    print(r.stdout[-2000:], r.stderr[-2000:], sep="\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ok


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        os.remove(path(f))
    make_resnets()
    make_mixed()
    make_hostile()
    write_readme()
    for name, size, _ in written:
        print(f"wrote tests/fixtures/pth/{name} ({size} bytes)")
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}")
    if not check_full_resnet50():
        sys.exit(1)


if __name__ == "__main__":
    main()
