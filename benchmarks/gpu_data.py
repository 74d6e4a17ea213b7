"""The CIFAR-10 subset that travels to a lent GPU (its working tree is limited to 64 MiB): every test image and the
first 1,000 training images of each class of the shared JPEG copy, in the same image-folder layout, uncompressed.

    python benchmarks/gpu_data.py .gpu-data/cifar10_sub.zip [--source ../shared/data/cifar10_jpeg.zip] [--train 1000]
"""

from __future__ import annotations

import argparse
import collections
import zipfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--source", type=Path, default=Path("../shared/data/cifar10_jpeg.zip"))
    ap.add_argument("--train", type=int, default=1000, help="training images per class")
    args = ap.parse_args()
    args.target.parent.mkdir(parents=True, exist_ok=True)
    count: collections.Counter[str] = collections.Counter()
    with zipfile.ZipFile(args.source) as src, zipfile.ZipFile(args.target, "w", zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            parts = name.split("/")
            if name.endswith("/") or len(parts) < 3 or parts[-3] not in ("train", "test"):
                continue
            if parts[-3] == "train":
                if count[parts[-2]] >= args.train:
                    continue
                count[parts[-2]] += 1
            dst.writestr(name, src.read(name))
    print(f"{args.target}: {sum(count.values())} training images and every test image")


if __name__ == "__main__":
    main()
