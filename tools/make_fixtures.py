#!/usr/bin/env python3
"""Generate the PyTorch reference fixtures in tests/fixtures/.

The Rust test-suite compares memfit's kernels (conv, batch norm, max pool,
cross entropy) and a whole tiny ResNet training step against the tensors
written here.  The fixtures are committed; this script is only needed to
regenerate them.  It does NOT install anything and the repository does not
depend on it.

How to run (from the repository root), with any Python environment that has
torch, torchvision, safetensors and numpy installed, e.g. a throw-away venv:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch torchvision safetensors numpy
    /tmp/torchvenv/bin/python tools/make_fixtures.py

Conventions of every file written:
  * all tensors are in PyTorch layout: activations NCHW, conv weights OIHW,
    linear weights (out, in);
  * floating tensors are float32, integer tensors are int64;
  * scalars (losses, num_batches_tracked) are stored as shape [1] tensors;
  * safetensors metadata holds `torch_version`, `torchvision_version`,
    `generator` ("tools/make_fixtures.py"), `seed`, and per-file parameters;
  * gradients named d<name> are the gradients of sum(y * dy) with respect
    to <name> (i.e. y.backward(dy)), unless stated otherwise.

tests/fixtures/README.md is regenerated alongside the fixtures.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.models.resnet import BasicBlock, Bottleneck, conv1x1
from safetensors.torch import save_file

GENERATOR = "tools/make_fixtures.py"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "tests", "fixtures")

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
torch.set_default_dtype(torch.float32)

# (file name, description, {tensor name: (dtype, shape)}, metadata) for README
_WRITTEN = []


def _prep(t):
    t = t.detach().clone().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.is_floating_point():
        assert t.dtype == torch.float32, t.dtype
    else:
        t = t.to(torch.int64)
    return t


def write(name, tensors, description, seed, extra_meta=None):
    tensors = {k: _prep(v) for k, v in tensors.items()}
    meta = {
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "generator": GENERATOR,
        "seed": str(seed),
    }
    if extra_meta:
        meta.update({k: str(v) for k, v in extra_meta.items()})
    path = os.path.join(OUT_DIR, name)
    save_file(tensors, path, metadata=meta)
    os.chmod(path, 0o644)  # safetensors creates files 0600
    _WRITTEN.append(
        (
            name,
            description,
            {k: (str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in tensors.items()},
            meta,
        )
    )
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


# ---------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------


def make_conv(name, seed, x_shape, w_shape, stride, padding):
    torch.manual_seed(seed)
    x = torch.randn(*x_shape).requires_grad_(True)
    w = (torch.randn(*w_shape) * 0.1).requires_grad_(True)
    y = F.conv2d(x, w, bias=None, stride=stride, padding=padding)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    write(
        name,
        {"x": x, "w": w, "y": y, "dy": dy, "dx": x.grad, "dw": w.grad},
        f"conv2d, kernel {w_shape[2]}x{w_shape[3]}, stride {stride}, padding {padding}, "
        "no bias, dilation 1, groups 1. Checks forward y and backward dx, dw "
        "(gradients of sum(y*dy)).",
        seed,
        {"stride": stride, "padding": padding},
    )


# ---------------------------------------------------------------------------
# Batch norm
# ---------------------------------------------------------------------------


def make_bn(seed=1000):
    torch.manual_seed(seed)
    c = 4
    bn = nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(c) + 0.5)
        bn.bias.copy_(torch.randn(c) * 0.3)
        bn.running_mean.copy_(torch.randn(c) * 0.2)
        bn.running_var.copy_(torch.rand(c) + 0.5)
        bn.num_batches_tracked.fill_(3)
    x0 = torch.randn(3, c, 5, 6) * 2 + 0.5
    weight0 = bn.weight.detach().clone()
    bias0 = bn.bias.detach().clone()
    rm0 = bn.running_mean.clone()
    rv0 = bn.running_var.clone()
    nbt0 = bn.num_batches_tracked.clone()

    # train-mode step
    bn.train()
    x = x0.clone().requires_grad_(True)
    y = bn(x)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    out = {
        "x": x0,
        "weight": weight0,
        "bias": bias0,
        "running_mean_before": rm0,
        "running_var_before": rv0,
        "num_batches_tracked_before": nbt0,
        "y": y,
        "dy": dy,
        "dx": x.grad,
        "dweight": bn.weight.grad,
        "dbias": bn.bias.grad,
        "running_mean_after": bn.running_mean,
        "running_var_after": bn.running_var,
        "num_batches_tracked_after": bn.num_batches_tracked,
    }

    # eval-mode pass with the updated running stats, same weight/bias, same x, same dy
    bn_e = nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)
    with torch.no_grad():
        bn_e.weight.copy_(weight0)
        bn_e.bias.copy_(bias0)
        bn_e.running_mean.copy_(bn.running_mean)
        bn_e.running_var.copy_(bn.running_var)
        bn_e.num_batches_tracked.copy_(bn.num_batches_tracked)
    bn_e.eval()
    xe = x0.clone().requires_grad_(True)
    ye = bn_e(xe)
    (ye * dy).sum().backward()
    out.update(
        {
            "y_eval": ye,
            "dx_eval": xe.grad,
            "dweight_eval": bn_e.weight.grad,
            "dbias_eval": bn_e.bias.grad,
        }
    )
    write(
        "bn_train.safetensors",
        out,
        "nn.BatchNorm2d(4, eps=1e-5, momentum=0.1). Train mode: y normalised with the "
        "biased batch variance; running_var updated with the UNBIASED batch variance "
        "(n/(n-1)); running = (1-momentum)*running + momentum*batch; num_batches_tracked "
        "3 -> 4. Eval mode (`*_eval`): same x, weight, bias, dy, using running_mean_after / "
        "running_var_after. Gradients are of sum(y*dy).",
        seed,
        {"eps": "1e-5", "momentum": "0.1"},
    )


# ---------------------------------------------------------------------------
# Max pool
# ---------------------------------------------------------------------------


def make_maxpool(seed=2000):
    torch.manual_seed(seed)
    pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
    out = {}
    for suffix, shape, hi in (("", (2, 3, 9, 9), 3), ("2", (1, 2, 8, 7), 2)):
        x0 = torch.randint(0, hi, shape).float()
        x = x0.clone().requires_grad_(True)
        y = pool(x)
        dy = torch.randn_like(y)
        (y * dy).sum().backward()
        out.update({f"x{suffix}": x0, f"y{suffix}": y, f"dy{suffix}": dy, f"dx{suffix}": x.grad})
    write(
        "maxpool_ties.safetensors",
        out,
        "nn.MaxPool2d(3, stride=2, padding=1) (padding acts as -inf). Inputs take values in "
        "{0,1,2} (x) / {0,1} (x2), so windows contain many ties. PyTorch (CPU) routes the "
        "gradient of each output to the FIRST maximal element of its window in row-major "
        "scan order (strict `>` comparison); overlapping windows accumulate into dx. "
        "x2 has even height (8) to exercise the far-edge padding.",
        seed,
        {"kernel_size": 3, "stride": 2, "padding": 1},
    )


# ---------------------------------------------------------------------------
# Cross entropy
# ---------------------------------------------------------------------------


def make_ce(seed=3000):
    torch.manual_seed(seed)
    logits0 = torch.randn(5, 7) * 2
    target = torch.randint(0, 7, (5,), dtype=torch.int64)
    lg = logits0.clone().requires_grad_(True)
    loss = F.cross_entropy(lg, target, reduction="mean")
    loss.backward()
    lg2 = logits0.clone().requires_grad_(True)
    loss_ls = F.cross_entropy(lg2, target, reduction="mean", label_smoothing=0.1)
    loss_ls.backward()
    write(
        "cross_entropy.safetensors",
        {
            "logits": logits0,
            "target": target,
            "loss": loss,
            "dlogits": lg.grad,
            "loss_ls": loss_ls,
            "dlogits_ls": lg2.grad,
        },
        "F.cross_entropy(logits, target), mean reduction over the batch. `loss`/`dlogits`: "
        "no label smoothing; `loss_ls`/`dlogits_ls`: label_smoothing=0.1 (target "
        "distribution (1-0.1)*onehot + 0.1/7). dlogits is d loss / d logits.",
        seed,
        {"reduction": "mean", "label_smoothing_ls": "0.1"},
    )


# ---------------------------------------------------------------------------
# Tiny ResNet (mirrors torchvision.models.resnet.ResNet, base width configurable)
# ---------------------------------------------------------------------------


class ResNet(nn.Module):
    """torchvision.models.resnet.ResNet with the 64-channel base width made a
    parameter (`base`).  Attribute names, _make_layer logic and init are
    torchvision's; blocks are torchvision's own BasicBlock / Bottleneck."""

    def __init__(self, block, layers, num_classes=10, base=8):
        super().__init__()
        norm_layer = nn.BatchNorm2d
        self._norm_layer = norm_layer
        self.inplanes = base
        self.dilation = 1
        self.groups = 1
        self.base_width = 64  # torchvision's width_per_group default -> Bottleneck width == planes
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, base, layers[0])
        self.layer2 = self._make_layer(block, 2 * base, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * base, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * base, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * base * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes, blocks, stride=1):
        norm_layer = self._norm_layer
        downsample = None
        previous_dilation = self.dilation
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                norm_layer(planes * block.expansion),
            )
        layers = [
            block(
                self.inplanes, planes, stride, downsample, self.groups,
                self.base_width, previous_dilation, norm_layer,
            )
        ]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(
                block(
                    self.inplanes, planes, groups=self.groups, base_width=self.base_width,
                    dilation=self.dilation, norm_layer=norm_layer,
                )
            )
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


def make_resnet(name, block, block_name, layers, seed, base=8, num_classes=10):
    torch.manual_seed(seed)
    model = ResNet(block, layers, num_classes=num_classes, base=base)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c) + 0.5)
                m.bias.copy_(torch.randn(c) * 0.1)
                m.running_mean.copy_(torch.randn(c) * 0.1)
                m.running_var.copy_(torch.rand(c) + 0.5)
    x = torch.randn(4, 3, 32, 32)
    labels = torch.randint(0, num_classes, (4,), dtype=torch.int64)

    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(x)
    loss = nn.CrossEntropyLoss(reduction="mean")(logits, labels)
    loss.backward()

    out["input.x"] = x
    out["input.labels"] = labels
    out["output.logits"] = logits
    out["output.loss"] = loss
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        out[f"grad.{pname}"] = p.grad
    for bname, b in model.named_buffers():
        if bname.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked"):
            out[f"after.{bname}"] = b
    layers_s = ",".join(str(n) for n in layers)
    write(
        name,
        out,
        f"ResNet mirroring torchvision's (torchvision {block.__name__} blocks), base width "
        f"{base}, layers [{layers_s}], {num_classes} classes, one train-mode forward + "
        "nn.CrossEntropyLoss(mean, no smoothing) backward (no optimizer step). Unprefixed "
        "names = model.state_dict() BEFORE the step (torchvision names); `grad.*` = gradient "
        "of output.loss w.r.t. every named parameter; `after.*` = BN running stats / "
        "num_batches_tracked after the forward. BN params/stats were randomised after "
        "torchvision's default init (BN eps 1e-5, momentum 0.1).",
        seed,
        {
            "layers": layers_s,
            "block": block_name,
            "base_width": str(base),
            "num_classes": str(num_classes),
            "bn_eps": "1e-5",
            "bn_momentum": "0.1",
        },
    )


# ---------------------------------------------------------------------------
# README
# ---------------------------------------------------------------------------


def write_readme():
    lines = [
        "# Reference fixtures",
        "",
        "Generated by `tools/make_fixtures.py` (do not edit by hand). Regenerate from the",
        "repository root with a Python environment that has torch, torchvision, safetensors",
        "and numpy, e.g.:",
        "",
        "```",
        "python3 -m venv /tmp/torchvenv",
        "/tmp/torchvenv/bin/pip install torch torchvision safetensors numpy",
        "/tmp/torchvenv/bin/python tools/make_fixtures.py",
        "```",
        "",
        f"Generated with torch `{torch.__version__}`, torchvision `{torchvision.__version__}`, "
        f"Python `{sys.version.split()[0]}` on CPU, `torch.use_deterministic_algorithms(True)`, "
        "`torch.set_num_threads(1)`, fixed `torch.manual_seed` per file (see the `seed` metadata).",
        "",
        "Conventions: PyTorch layout everywhere (activations NCHW, conv weights OIHW, linear",
        "weights (out, in)); floats are float32, integers int64; scalars are shape `[1]`.",
        "Each file's safetensors metadata holds `torch_version`, `torchvision_version`,",
        "`generator`, `seed` and the per-file parameters listed below. `dX` for a",
        "kernel fixture is the gradient of `sum(y * dy)` w.r.t. `X`.",
        "",
    ]
    for name, desc, tensors, meta in _WRITTEN:
        size = os.path.getsize(os.path.join(OUT_DIR, name))
        lines += [f"## `{name}` ({size} bytes)", "", desc, ""]
        extra = {k: v for k, v in meta.items()
                 if k not in ("torch_version", "torchvision_version", "generator")}
        lines += ["Metadata: " + ", ".join(f"`{k}`=`{v}`" for k, v in extra.items()), ""]
        lines += ["| tensor | dtype | shape |", "|---|---|---|"]
        for k, (dt, shape) in tensors.items():
            lines.append(f"| `{k}` | {dt} | {shape} |")
        lines.append("")
    with open(os.path.join(OUT_DIR, "README.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.join(OUT_DIR, 'README.md')}")


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    make_conv("conv_7x7_s2_p3.safetensors", 1, (2, 3, 13, 11), (4, 3, 7, 7), 2, 3)
    make_conv("conv_3x3_s2_p1.safetensors", 2, (2, 5, 9, 8), (6, 5, 3, 3), 2, 1)
    make_conv("conv_1x1_s2.safetensors", 3, (2, 5, 9, 7), (6, 5, 1, 1), 2, 0)
    make_conv("conv_3x3_s1_p1.safetensors", 4, (1, 4, 7, 5), (3, 4, 3, 3), 1, 1)
    make_bn()
    make_maxpool()
    make_ce()
    make_resnet("tiny_resnet_bottleneck.safetensors", Bottleneck, "bottleneck", [2, 1, 1, 1], 4000)
    make_resnet("tiny_resnet_basic.safetensors", BasicBlock, "basic", [1, 1, 1, 1], 5000)
    write_readme()


if __name__ == "__main__":
    main()
