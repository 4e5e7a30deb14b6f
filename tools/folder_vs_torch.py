#!/usr/bin/env python3
"""Train a torchvision ResNet on an image folder with the reference recipe
memfit's defaults follow, for a side-by-side with `memfit train` on the same
folder: SGD (momentum 0.9), lr = 0.1 x batch / 256 (the linear scaling rule)
unless --lr is given, cosine decay per optimizer step to 0 (memfit's default
schedule), RandomResizedCrop + horizontal flip, ImageNet normalisation, the
validation transform resize(size*256/224) + centre crop. Prints the mean
train loss per epoch and the validation top-1, in the form memfit's epoch
lines use, so the two logs compare line by line.

usage: tools/folder_vs_torch.py --data DIR [--val-data DIR] [--model resnet50]
         [--image-size 64] [--batch-size 16] [--epochs 3] [--lr X]
         [--weight-decay 5e-4] [--seed 0] [--threads 2]
needs torch and torchvision (tools/bench_vs_torch.sh --install-torch makes a
venv with both).
"""
import argparse
import math
import time

import torch
import torchvision
from torchvision import transforms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--val-data")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(a.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm])
    val_tf = transforms.Compose([
        transforms.Resize(a.image_size * 256 // 224), transforms.CenterCrop(a.image_size),
        transforms.ToTensor(), norm])
    train = torchvision.datasets.ImageFolder(a.data, train_tf)
    loader = torch.utils.data.DataLoader(train, batch_size=a.batch_size, shuffle=True,
                                         num_workers=2)
    model = getattr(torchvision.models, a.model)(num_classes=len(train.classes))
    lr = a.lr if a.lr is not None else 0.1 * a.batch_size / 256
    why = "--lr" if a.lr is not None else f"0.1 x batch {a.batch_size} / 256"
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}: "
          f"{a.model} on {a.data} ({len(train)} images, {len(train.classes)} classes) "
          f"at {a.image_size}x{a.image_size}, lr {lr} ({why})")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=a.weight_decay)
    total = a.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(1, a.epochs + 1):
        model.train()
        t0, loss_sum, correct, seen = time.time(), 0.0, 0, 0
        for x, y in loader:
            out = model(x)
            loss = loss_fn(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item() * len(y)
            correct += (out.argmax(1) == y).sum().item()
            seen += len(y)
        line = (f"epoch {epoch}: train loss {loss_sum / seen:.4f}, "
                f"train top-1 {100 * correct / seen:.1f}%")
        if a.val_data:
            val = torchvision.datasets.ImageFolder(a.val_data, val_tf)
            model.eval()
            with torch.no_grad():
                hits = sum((model(x).argmax(1) == y).sum().item()
                           for x, y in torch.utils.data.DataLoader(val, batch_size=64))
            line += f", val top-1 {100 * hits / len(val):.2f}%"
        print(f"{line}, {seen / (time.time() - t0):.1f} img/s", flush=True)


if __name__ == "__main__":
    main()
