"""Datasets: a folder of images (or clips), their captions, aspect buckets and the data order.

A dataset folder holds either
- images with same-named `.txt` captions (`cat.png` + `cat.txt`), or
- a `metadata.jsonl` (one {"file_name": ..., "text": ...} per line) or `metadata.csv` with those columns
  (the column names are `train.image_column` / `train.caption_column`).
For Wan an item may also be a clip: a sub-folder of numbered frames (`clip_00/000.png, ...`),
captioned like an image (`clip_00.txt` or a metadata row whose file_name is `clip_00`).

Everything a user can get wrong is checked up front and raised as DatasetError naming the file, so
a job fails at setup instead of at step 900.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.runners.errors import DatasetError  # on the tree drawn in jobs.errors

__all__ = ["DatasetError", "Item", "scan_dataset", "make_buckets", "nearest_bucket", "load_pixels", "epoch_order",
           "IMAGE_SUFFIXES", "MAX_IMAGE_PIXELS", "read_text"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# PIL's decompression-bomb limit (its MAX_IMAGE_PIXELS default): a larger image is refused from its
# header, before anything is decoded (a 20000x20000 PNG of a few KB would take 1.2 GB to decode).
MAX_IMAGE_PIXELS = 89_478_485


def read_text(path: Path, error: type[ValueError] | None = None) -> str:
    """A caption, metadata or prompt file as UTF-8; anything else is one line naming the file and the byte."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise (error or DatasetError)(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "save it as UTF-8") from None
    except OSError as exc:
        raise (error or DatasetError)(f"{path}: cannot read: {exc.strerror or exc}") from None


@dataclass
class Item:
    name: str                      # the file_name it was listed under
    files: list[Path]              # one image, or the frames of a clip in order
    caption: str
    size: tuple[int, int] = (0, 0)  # (width, height) of the first frame
    digest: str = ""               # sha256 of the file bytes (all frames of a clip)
    bucket: tuple[int, int] = (0, 0)
    extra: dict[str, Any] = field(default_factory=dict)


def _read_metadata(root: Path, image_column: str, caption_column: str) -> list[tuple[str, str]] | None:
    jsonl, csv_file = root / "metadata.jsonl", root / "metadata.csv"
    rows: list[dict[str, Any]] = []
    if jsonl.is_file():
        src = jsonl
        for n, line in enumerate(read_text(jsonl).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{jsonl}:{n}: not a JSON object ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{jsonl}:{n}: not a JSON object")
            rows.append(row | {"__line__": n})
    elif csv_file.is_file():
        src = csv_file
        reader = csv.DictReader(io.StringIO(read_text(csv_file), newline=""))
        for n, row in enumerate(reader, 2):
            rows.append(dict(row) | {"__line__": n})
        header = reader.fieldnames or []
        for col in (image_column, caption_column):
            if col not in header:
                raise DatasetError(f"{csv_file}: no `{col}` column (columns: {', '.join(header) or 'none'}); "
                                   f"set train.image_column / train.caption_column")
    else:
        return None
    out = []
    for row in rows:
        for col in (image_column, caption_column):
            if col not in row:
                raise DatasetError(f"{src}:{row['__line__']}: no `{col}` field (has: "
                                   f"{', '.join(k for k in row if k != '__line__')}); set train.image_column / train.caption_column")
        out.append((str(row[image_column]), str(row[caption_column])))
    return out


def _frames(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def _resolve(root: Path, name: str, allow_clips: bool) -> list[Path]:
    p = root / name
    if p.is_file():
        return [p]
    if allow_clips and p.is_dir():
        frames = _frames(p)
        if not frames:
            raise DatasetError(f"{p}: a clip folder without frames ({', '.join(IMAGE_SUFFIXES)})")
        return frames
    raise DatasetError(f"{p}: listed in the metadata but missing")


def _digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def _check_image(path: Path) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    def too_big(w: int, h: int) -> DatasetError:
        return DatasetError(f"{path}: {w}x{h} is {w * h:,} pixels, more than the {MAX_IMAGE_PIXELS:,} an image may "
                            "have (PIL's decompression-bomb limit); downscale it")

    try:
        with Image.open(path) as im:  # reads the header only: the size is known before any decoding
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise too_big(im.width, im.height)
            im.verify()
        with Image.open(path) as im:  # verify() leaves the file unusable; reopen to read the size
            im.load()
            return im.size
    except DatasetError:
        raise
    except Image.DecompressionBombError:  # a size PIL itself refuses at open (past twice its limit)
        raise DatasetError(f"{path}: larger than the {MAX_IMAGE_PIXELS:,} pixels an image may have "
                           "(PIL's decompression-bomb limit); downscale it") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DatasetError(f"{path}: unreadable image ({type(exc).__name__}: {exc})") from None


def scan_dataset(path: str | Path, *, image_column: str = "file_name", caption_column: str = "text",
                 allow_clips: bool = False, default_caption: str | None = None) -> list[Item]:
    """Every item of the dataset, checked: files exist and decode, each has a caption (or `default_caption`)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DatasetError(f"train.dataset: {root} is not a folder")
    listed = _read_metadata(root, image_column, caption_column)
    items: list[Item] = []
    if listed is not None:
        for name, caption in listed:
            caption = caption.strip() or default_caption or ""
            items.append(Item(name=name, files=_resolve(root, name, allow_clips), caption=caption))
    else:
        entries = sorted(root.iterdir())
        for p in entries:
            is_image = p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
            is_clip = allow_clips and p.is_dir() and not p.name.startswith(".")
            if not (is_image or is_clip):
                continue
            txt = p.with_suffix(".txt") if is_image else p.parent / (p.name + ".txt")
            if not txt.is_file() and default_caption is None:
                raise DatasetError(f"{p}: no caption ({txt.name} is missing, and there is no metadata.jsonl/.csv; "
                                   "or set train.default_caption)")
            files = [p] if is_image else _frames(p)
            if not files:
                continue
            caption = read_text(txt).strip() if txt.is_file() else default_caption
            items.append(Item(name=p.name, files=files, caption=caption))
    if not items:
        kinds = "images or clip folders" if allow_clips else "images"
        raise DatasetError(f"train.dataset: {root} has no {kinds} ({', '.join(IMAGE_SUFFIXES)})")
    for it in items:
        sizes = {_check_image(f) for f in it.files}
        if len(sizes) > 1:
            raise DatasetError(f"{it.files[0].parent}: frames of one clip differ in size ({sorted(sizes)})")
        it.size = sizes.pop()
        it.digest = _digest(it.files)
    return items


# ---------------------------------------------------------------- buckets
def make_buckets(max_pixels: int, multiple: int, max_ratio: float = 4.0) -> list[tuple[int, int]]:
    """(width, height) pairs, sides a multiple of `multiple`, area <= max_pixels, the largest per width."""
    out = []
    w = multiple
    while w * multiple <= max_pixels:
        h = (max_pixels // w) // multiple * multiple
        if h >= multiple and 1 / max_ratio <= w / h <= max_ratio:
            out.append((w, h))
        w += multiple
    if not out:
        side = max(multiple, int(math.sqrt(max_pixels)) // multiple * multiple)
        out.append((side, side))
    return out


def nearest_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket closest in aspect ratio (log scale); ties go to the larger area. Never upscales past the image."""
    w, h = size
    ratio = math.log(w / h)
    fits = [b for b in buckets if b[0] <= w and b[1] <= h] or buckets
    best = min(fits, key=lambda b: (round(abs(math.log(b[0] / b[1]) - ratio), 6), -b[0] * b[1]))
    return best


def load_pixels(item: Item, num_frames: int = 1) -> Any:
    """The item resized (cover) and center-cropped to its bucket, as a float tensor in [-1, 1].

    Images give (3, H, W); clips (and images when num_frames is asked for) give (3, F, H, W).
    """
    import numpy as np
    import torch
    from PIL import Image

    bw, bh = item.bucket
    frames = item.files[:num_frames] if len(item.files) > 1 else item.files
    arrays = []
    for f in frames:
        with Image.open(f) as im:
            im = im.convert("RGB")
            scale = max(bw / im.width, bh / im.height)
            rw, rh = max(bw, round(im.width * scale)), max(bh, round(im.height * scale))
            im = im.resize((rw, rh), Image.BICUBIC)
            left, top = (rw - bw) // 2, (rh - bh) // 2
            im = im.crop((left, top, left + bw, top + bh))
            arrays.append(np.asarray(im, dtype=np.float32))
    x = torch.from_numpy(np.stack(arrays)).permute(3, 0, 1, 2) / 127.5 - 1.0  # (3, F, H, W)
    return x if len(item.files) > 1 or num_frames > 1 else x[:, 0]


# ---------------------------------------------------------------- order
def epoch_order(items: list[Item], repeats: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The micro-batches of one epoch: indices of items of one bucket, shuffled by (seed, epoch).

    A pure function of its arguments, so a resumed job walks the same order; checkpoints also keep it.
    """
    rng = random.Random(f"{seed}:{epoch}")
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i, it in enumerate(items):
        by_bucket.setdefault(it.bucket, []).extend([i] * repeats)
    batches: list[list[int]] = []
    for key in sorted(by_bucket):
        idx = by_bucket[key]
        rng.shuffle(idx)
        batches.extend(idx[j:j + batch_size] for j in range(0, len(idx), batch_size))
    rng.shuffle(batches)
    return batches
