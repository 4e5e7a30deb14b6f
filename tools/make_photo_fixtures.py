#!/usr/bin/env python3
"""Writes the tiny ImageFolder of real photos used by tests/folder.rs and
tests/cli.rs:

    tests/fixtures/photos/{train,val}/{cat,coffee,space}/*.{jpg,png}
    tests/fixtures/photos_corrupt/{cat,coffee}/...   (one truncated JPEG)

The pixels are crops and downscales of photos bundled in the scikit-image
wheel (skimage/data, no download), chosen for their licences (CC0 or public
domain, see tests/fixtures/photos/README.md). Crops are fixed, not random, so
rerunning the script reproduces the files given the same scikit-image and
Pillow versions.

Usage (a throw-away venv is enough):
    python3 -m venv /tmp/skvenv && /tmp/skvenv/bin/pip install scikit-image
    /tmp/skvenv/bin/python tools/make_photo_fixtures.py
"""

import io
import pathlib
import shutil

import numpy as np
import PIL
import skimage
from PIL import Image
from skimage import data

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
PHOTOS = ROOT / "photos"
CORRUPT = ROOT / "photos_corrupt"

# name -> (loader, licence line for the README)
SOURCES = {
    "chelsea": (data.chelsea, "CC0, by the photographer Stefan van der Walt"),
    "coffee": (data.coffee, "CC0, by the photographer Rachel Michetti"),
    "astronaut": (data.astronaut, "NASA, public domain (no known copyright restrictions)"),
    "rocket": (data.rocket, "SpaceX, released into the public domain"),
    "hubble_deep_field": (data.hubble_deep_field, "NASA, public domain"),
}

# (split, class, file name, source, crop box (top, left, height, width),
#  output (width, height), mode). Modes: RGB (JPEG or PNG by extension;
#  "RGB progressive" for a progressive JPEG), L (grayscale), RGBA (PNG with
#  a gradient alpha), P (palette PNG), I;16 (16-bit grayscale PNG).
IMAGES = [
    ("train", "cat", "chelsea_face.jpg", "chelsea", (20, 130, 200, 200), (64, 64), "RGB"),
    ("train", "cat", "chelsea_wide.png", "chelsea", (0, 0, 300, 451), (90, 60), "RGB"),
    ("train", "cat", "chelsea_tall.jpg", "chelsea", (40, 180, 240, 150), (50, 80), "RGB progressive"),
    ("train", "coffee", "coffee_cup.jpg", "coffee", (50, 150, 300, 300), (72, 72), "RGB"),
    ("train", "coffee", "coffee_table.png", "coffee", (0, 0, 400, 600), (96, 64), "RGBA"),
    ("train", "coffee", "coffee_saucer.png", "coffee", (200, 100, 200, 400), (96, 48), "P"),
    ("train", "space", "astronaut.jpg", "astronaut", (0, 100, 300, 300), (64, 64), "RGB"),
    ("train", "space", "rocket_gray.png", "rocket", (0, 150, 427, 300), (56, 80), "L"),
    ("train", "space", "hubble.jpg", "hubble_deep_field", (100, 100, 500, 700), (84, 60), "RGB"),
    ("val", "cat", "chelsea_eye.png", "chelsea", (60, 200, 120, 120), (48, 48), "RGB"),
    ("val", "coffee", "coffee_top.jpg", "coffee", (0, 100, 250, 400), (80, 50), "RGB"),
    ("val", "space", "hubble_16bit.png", "hubble_deep_field", (400, 300, 400, 400), (60, 60), "I;16"),
    ("val", "space", "rocket.jpg", "rocket", (50, 200, 350, 250), (50, 70), "L"),
]


def render(src, box, size, mode):
    top, left, h, w = box
    crop = Image.fromarray(src[top : top + h, left : left + w])
    img = crop.resize(size, Image.Resampling.LANCZOS)
    if mode == "L":
        return img.convert("L")
    if mode == "RGBA":
        alpha = np.tile(np.linspace(64, 255, size[0], dtype=np.uint8), (size[1], 1))
        rgba = img.convert("RGBA")
        rgba.putalpha(Image.fromarray(alpha))
        return rgba
    if mode == "P":
        return img.quantize(colors=32)
    if mode == "I;16":
        gray = np.asarray(img.convert("L"), dtype=np.uint16) * 257
        return Image.fromarray(gray)  # uint16 -> mode I;16
    return img


def expected(path):
    """(height, width, per-channel means) of the file as RGB: Pillow's
    convert("RGB"), except 16-bit samples, which keep their high byte
    (Pillow would clip them to 255)."""
    img = Image.open(path)
    if img.mode == "I;16":
        rgb = np.repeat((np.asarray(img, dtype=np.uint16) >> 8)[..., None], 3, axis=2)
    else:
        rgb = np.asarray(img.convert("RGB"))
    means = rgb.reshape(-1, 3).astype(np.float64).mean(axis=0)
    return (rgb.shape[0], rgb.shape[1], *(f"{m:.6f}" for m in means))


def save(img, path, progressive=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jpg":
        img.save(path, quality=85, optimize=True, progressive=progressive)
    else:
        img.save(path, optimize=True)


def main():
    for d in (PHOTOS / "train", PHOTOS / "val", CORRUPT):
        shutil.rmtree(d, ignore_errors=True)
    loaded = {name: loader() for name, (loader, _) in SOURCES.items()}
    lines = ["# file\theight\twidth\tmean_r\tmean_g\tmean_b (decoded by Pillow, see README.md)"]
    for split, cls, name, src, box, size, mode in IMAGES:
        path = PHOTOS / split / cls / name
        save(render(loaded[src], box, size, mode.split()[0]), path, "progressive" in mode)
        lines.append("\t".join([f"{split}/{cls}/{name}", *map(str, expected(path))]))
    (PHOTOS / "expected.tsv").write_text("\n".join(lines) + "\n")

    # The corrupt-file fixture: two good images and a JPEG cut in half
    # (its entropy-coded data ends early, no EOI marker).
    good = render(loaded["chelsea"], (20, 130, 200, 200), (40, 40), "RGB")
    save(good, CORRUPT / "cat" / "ok.jpg")
    save(render(loaded["coffee"], (50, 150, 300, 300), (40, 40), "RGB"), CORRUPT / "coffee" / "ok.png")
    buf = io.BytesIO()
    good.save(buf, format="JPEG", quality=85)
    jpeg = buf.getvalue()
    (CORRUPT / "cat" / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])

    total = sum(p.stat().st_size for p in ROOT.glob("photos*/**/*") if p.is_file())
    print(f"scikit-image {skimage.__version__}, Pillow {PIL.__version__}: {total} bytes")


if __name__ == "__main__":
    main()
