"""Data and size mistakes end as one line naming the file or field, through a real worker:
at submit (exit 2 / SpecError) where the spec shows the value, at setup (setup_failed) otherwise.
Also a same-size change to a lazy_load shard fails the infer job by name (not SUCCEEDED)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from runner_helpers import copy_dataset, events, infer_spec, log, run_dir, train_spec

from jobs.errors import SpecError


def _png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header says width x height, with a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                     + chunk(b"IEND", b""))
    return path


def _setup_cases(tiny: dict[str, Path], tmp: Path) -> dict[str, tuple[dict, str]]:
    """name -> (spec, the words the setup_failed message must hold)."""
    latin1 = copy_dataset(tiny["images"], tmp / "latin1")
    caption = sorted(latin1.glob("*.txt"))
    if caption:  # .txt captions: one of them in Latin-1
        bad_file = caption[0]
    else:  # a metadata file: it in Latin-1
        bad_file = next(p for p in (latin1 / "metadata.jsonl", latin1 / "metadata.csv") if p.is_file())
    bad_file.write_bytes(bad_file.read_bytes() + "un caf\u00e9 cr\u00e8me".encode("latin-1"))

    def with_png(name: str, side: int) -> Path:
        folder = copy_dataset(tiny["images"], tmp / name)
        _png_header_only(folder / "huge.png", side, side)
        (folder / "huge.txt").write_text("a very large picture")
        if (folder / "metadata.jsonl").is_file():
            with open(folder / "metadata.jsonl", "a") as f:
                f.write(json.dumps({"file_name": "huge.png", "text": "a very large picture"}) + "\n")
        return folder

    bomb, large = with_png("bomb", 20000), with_png("large", 10000)  # past twice PIL's limit / past it

    prompt_file = tmp / "samples.txt"
    prompt_file.write_text("a red square --w 60000 --h 60000\n")

    def train_on(folder: Path, **train: object) -> dict:
        spec = train_spec(tiny, "flux", **train)
        spec["train"]["dataset"] = str(folder)
        return spec

    return {
        "caption not utf-8": (train_on(latin1), f"{bad_file}: not UTF-8 text"),
        "decompression bomb": (train_on(bomb), f"{bomb / 'huge.png'}: larger than the 89,478,485 pixels an image may"),
        "too many pixels": (train_on(large), f"{large / 'huge.png'}: 10000x10000 is 100,000,000 pixels, more than"),
        "sample prompt file too large": (train_spec(tiny, "flux", sample_prompts=str(prompt_file), sample_every=10),
                                         "--w 60000 is outside 8..8192"),
        # within each field's bound, but not together on any machine's memory
        "frames x resolution": (infer_spec(tiny, "wan", width=8192, height=8192, num_frames=10_000),
                                "infer.width x infer.height x infer.num_frames: 8192x8192 x 10000 frames needs about"),
        "pixels x batch": (train_spec(tiny, "flux", max_pixels=8192 * 8192, batch_size=65536),
                           "train.max_pixels x train.batch_size: 67,108,864 pixels, 65536 at once needs about"),
    }


def test_data_mistakes_fail_at_setup_with_one_line(client, tiny: dict[str, Path], tmp_path: Path) -> None:
    cases = _setup_cases(tiny, tmp_path)
    jobs = {name: client.submit(spec)["id"] for name, (spec, _) in cases.items()}
    for name, job_id in jobs.items():
        job = client.wait(job_id, timeout=180)
        words = cases[name][1]
        assert (job["status"], job["reason"]) == ("FAILED", "setup_failed"), f"{name}: {job['status']} {job['reason']}"
        assert words in (job.get("message") or ""), f"{name}: {job.get('message')!r}"
        assert "\n" not in job["message"].strip(), f"{name}: more than one line"
        assert "Traceback" not in log(job), f"{name}: a traceback in the log:\n{log(job)[-1500:]}"


@pytest.mark.parametrize("section,values,field", [
    ("train", {"max_pixels": 268435456}, "train.max_pixels"),
    ("infer", {"width": 65536, "height": 65536}, "infer.height"),
    ("infer", {"prompt": "a --w 60000 --h 60000"}, "infer.prompt"),
    ("train", {"sample_prompts": ["a --h 60000"]}, "train.sample_prompts"),
    ("train", {"num_frames": 10**6}, "train.num_frames"),
])
def test_sizes_the_spec_shows_are_refused_at_submit(client, tiny: dict[str, Path], section: str, values: dict,
                                                    field: str) -> None:
    spec = train_spec(tiny, "flux", **values) if section == "train" else infer_spec(tiny, "flux", **values)
    before = len(client.list())
    with pytest.raises(SpecError) as info:
        client.submit(spec)
    assert field in str(info.value), str(info.value)
    assert len(client.list()) == before  # nothing was queued


def _scale_a_tensor(shards: Path, factor: float = 100.0) -> Path:
    """One tensor of one block's unit x100, in place: the file keeps its size."""
    import torch

    index = json.loads((shards / "index.json").read_text())
    name, unit = next((n, u) for n, u in index["units"].items() if "blocks.0" in n)
    tname, t = next(iter(unit["tensors"].items()))
    path = shards / unit["file"]
    raw = bytearray(path.read_bytes())
    start = unit["offset"] + t["offset"]
    dtype = getattr(torch, t["dtype"])
    x = torch.frombuffer(bytearray(raw[start:start + t["nbytes"]]), dtype=dtype) * factor
    raw[start:start + t["nbytes"]] = x.view(torch.uint8).numpy().tobytes()
    size = path.stat().st_size
    path.write_bytes(bytes(raw))
    assert path.stat().st_size == size
    return path


def test_a_changed_shard_fails_a_lazy_load_job_by_name(client, tiny: dict[str, Path], tmp_path: Path) -> None:
    from offload_core.shard import shard_checkpoint

    shards = tmp_path / "shards"
    shard_checkpoint(tiny["wan"] / "transformer", shards, progress=False)

    def lazy_job() -> dict:
        spec = infer_spec(tiny, "wan", prompt=["a red square"], steps=2, num_frames=5)
        spec["offload"].update({"lazy_load": True, "shard_dir": str(shards), "max_memory": 0})
        return client.wait(client.submit(spec)["id"], timeout=240)

    good = lazy_job()
    assert good["status"] == "SUCCEEDED", (good.get("reason"), good.get("message"), log(good)[-1500:])
    bad_file = _scale_a_tensor(shards)
    bad = lazy_job()
    assert (bad["status"], bad["reason"]) == ("FAILED", "setup_failed"), (bad["status"], bad.get("reason"))
    assert f"{bad_file}: unit " in bad["message"] and "does not match" in bad["message"], bad["message"]
    assert "Traceback" not in log(bad)
    assert not list((run_dir(bad) / "outputs").glob("*.png"))
    assert any(e.get("status") == "FAILED" for e in events(bad, "job.status"))
