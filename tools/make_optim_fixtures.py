#!/usr/bin/env python3
"""Generate the PyTorch reference fixtures of the optimizer module
(tests/fixtures/optim_*.safetensors), checked by tests/optim_parity.rs.

The fixtures are committed; this script is only needed to regenerate them.
It installs nothing and the repository does not depend on it.

How to run (from the repository root), with any Python environment that has
torch, torchvision, safetensors and numpy, e.g. a throw-away venv:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch torchvision safetensors numpy
    /tmp/torchvenv/bin/python tools/make_optim_fixtures.py

Files written (PyTorch layout: conv weights OIHW, activations NCHW; floats
float32, integers int64, scalars shape [1]; metadata holds `torch_version`,
`torchvision_version`, `generator`, `seed` and the per-file hyper-parameters):

  optim_sgd_resnet.safetensors
      Tiny torchvision-layout ResNet (BasicBlock, layers [1,1,1,1], base width 8,
      10 classes, BN weights/biases/stats randomised as in tools/make_fixtures.py),
      input 4x3x32x32, model.train(). Unprefixed names: state_dict BEFORE.
      Two steps on the same batch of: zero_grad, CrossEntropyLoss(mean), backward,
      torch.optim.SGD(lr 0.1, momentum 0.9, weight_decay 1e-3).step().
      `output.loss1`, `output.loss2`: losses of the two steps; `output.grad_norm1`:
      torch.nn.utils.get_total_norm of the step-1 gradients (L2); `after.<name>`:
      every parameter, BN running stat and num_batches_tracked after step 2.
  optim_adamw.safetensors
      torch.optim.AdamW(lr 0.01, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01)
      on three raw parameters p0 [7], p1 [3,5], p2 [2,2,3]; 5 steps, the gradient
      of step s (1-based) is set by hand to `grad<s>.p<i>`; `init.p<i>` before and
      `step<s>.p<i>` after each step.
  optim_schedule.safetensors
      `warmup_cosine` [20]: lr used by optimizer step t = 0..19 (SGD lr 0.1) under
      SequentialLR([LinearLR(start_factor=1/3, end_factor=1, total_iters=3),
      CosineAnnealingLR(T_max=20-3, eta_min=0.001)], milestones=[3]);
      `step` [20]: same for StepLR(step_size=5, gamma=0.5). The schedulers compute
      in Python floats; stored rounded to float32.
  optim_clip.safetensors
      torch.nn.utils.clip_grad_norm_(max_norm=1.0, norm_type=2) on the gradients
      `grad.g<i>` of three raw parameters: `total_norm` (returned, before
      clipping) and `clipped.g<i>`. A second call with max_norm=100 (no clipping):
      `total_norm_big`, and the grads are unchanged.
"""

import os

import torch
import torch.nn as nn
import torchvision
from safetensors.torch import save_file
from torchvision.models.resnet import BasicBlock

import make_fixtures  # the tiny ResNet class (tools/ is on sys.path when run as a script)

GENERATOR = "tools/make_optim_fixtures.py"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "tests", "fixtures")

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
torch.set_default_dtype(torch.float32)


def _prep(t):
    t = t.detach().clone().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if not t.is_floating_point():
        t = t.to(torch.int64)
    return t


def write(name, tensors, seed, extra_meta):
    tensors = {k: _prep(v) for k, v in tensors.items()}
    meta = {
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "generator": GENERATOR,
        "seed": str(seed),
    }
    meta.update({k: str(v) for k, v in extra_meta.items()})
    path = os.path.join(OUT_DIR, name)
    save_file(tensors, path, metadata=meta)
    os.chmod(path, 0o644)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def make_sgd_resnet(seed=6000, lr=0.1, momentum=0.9, weight_decay=1e-3):
    torch.manual_seed(seed)
    model = make_fixtures.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10, base=8)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c) + 0.5)
                m.bias.copy_(torch.randn(c) * 0.1)
                m.running_mean.copy_(torch.randn(c) * 0.1)
                m.running_var.copy_(torch.rand(c) + 0.5)
    x = torch.randn(4, 3, 32, 32)
    labels = torch.randint(0, 10, (4,), dtype=torch.int64)
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["input.x"] = x
    out["input.labels"] = labels
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    for step in (1, 2):
        opt.zero_grad(set_to_none=True)
        loss = nn.CrossEntropyLoss(reduction="mean")(model(x), labels)
        loss.backward()
        if step == 1:
            grads = [p.grad for p in model.parameters()]
            out["output.grad_norm1"] = torch.nn.utils.get_total_norm(grads, 2.0)
        opt.step()
        out[f"output.loss{step}"] = loss
    for k, v in model.state_dict().items():
        out[f"after.{k}"] = v
    write(
        "optim_sgd_resnet.safetensors",
        out,
        seed,
        {
            "layers": "1,1,1,1",
            "block": "basic",
            "base_width": 8,
            "num_classes": 10,
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "nesterov": False,
            "steps": 2,
        },
    )


def make_adamw(seed=6100, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, steps=5):
    torch.manual_seed(seed)
    shapes = [(7,), (3, 5), (2, 2, 3)]
    params = [nn.Parameter(torch.randn(*s)) for s in shapes]
    out = {f"init.p{i}": p.detach().clone() for i, p in enumerate(params)}
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    for s in range(1, steps + 1):
        for i, p in enumerate(params):
            # mixed magnitudes, so eps and the bias corrections matter
            g = torch.randn(*p.shape) * (10.0 ** (i - 2))
            p.grad = g
            out[f"grad{s}.p{i}"] = g.clone()
        opt.step()
        for i, p in enumerate(params):
            out[f"step{s}.p{i}"] = p.detach().clone()
    write(
        "optim_adamw.safetensors",
        out,
        seed,
        {
            "lr": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": eps,
            "weight_decay": weight_decay,
            "steps": steps,
            "params": len(shapes),
        },
    )


def _lrs(make_sched, base_lr, n):
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = make_sched(opt)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])  # lr used by this optimizer step
        opt.step()
        sched.step()
    return torch.tensor(lrs, dtype=torch.float64).to(torch.float32)


def make_schedule(base_lr=0.1, n=20, warmup=3, eta_min=0.001, step_size=5, gamma=0.5):
    LR = torch.optim.lr_scheduler

    def warmup_cosine(opt):
        return LR.SequentialLR(
            opt,
            [
                LR.LinearLR(opt, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup),
                LR.CosineAnnealingLR(opt, T_max=n - warmup, eta_min=eta_min),
            ],
            milestones=[warmup],
        )

    out = {
        "warmup_cosine": _lrs(warmup_cosine, base_lr, n),
        "step": _lrs(lambda opt: LR.StepLR(opt, step_size=step_size, gamma=gamma), base_lr, n),
    }
    write(
        "optim_schedule.safetensors",
        out,
        0,
        {
            "base_lr": base_lr,
            "steps": n,
            "warmup_steps": warmup,
            "warmup_start_factor": "1/3",
            "total_steps": n,
            "eta_min": eta_min,
            "step_size": step_size,
            "gamma": gamma,
        },
    )


def make_clip(seed=6200):
    torch.manual_seed(seed)
    shapes = [(4, 3), (5,), (2, 3, 2)]
    params = [nn.Parameter(torch.zeros(*s)) for s in shapes]
    out = {}
    for i, p in enumerate(params):
        p.grad = torch.randn(*p.shape)
        out[f"grad.g{i}"] = p.grad.clone()
    out["total_norm"] = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, norm_type=2.0)
    for i, p in enumerate(params):
        out[f"clipped.g{i}"] = p.grad.clone()
        p.grad = out[f"grad.g{i}"].clone()
    out["total_norm_big"] = torch.nn.utils.clip_grad_norm_(params, max_norm=100.0)
    for i, p in enumerate(params):
        assert torch.equal(p.grad, out[f"grad.g{i}"])
    write("optim_clip.safetensors", out, seed, {"max_norm": 1.0, "max_norm_big": 100.0})


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    make_sgd_resnet()
    make_adamw()
    make_schedule()
    make_clip()


if __name__ == "__main__":
    main()
