"""The bounce ring's cost to the engine's own thread: the Python ring against the native one.

    python -m bench.ring_gil [--device cpu|cuda] [--threads 1,16] [--chunks-mib 16] [--seconds 3]

An engine-like thread runs small torch ops (the dispatcher and the GIL, as the engine's thread
launching kernels) while a mover thread pushes 512 MiB of pageable bytes through each ring again
and again (to host memory on the CPU; to the device on a copy stream with CUDA). Prints the
engine-like thread's op rate against its rate alone, and the ring's GB/s in that time. The Python
ring (bounce._Ring) takes the GIL several times a chunk in each thread; the native one
(bounce._NativeRing, native/bounce_ring.c) does not take it per chunk at all.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from offload_core import bounce, streamcopy


def _load_rate(seconds: float) -> float:
    a, b = torch.randn(256), torch.randn(256)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            a = torch.add(a, b).mul_(0.5)
        n += 200
    return n / (time.perf_counter() - t0)


def _run(kind: str, threads: int, chunk: int, device: torch.device, src: torch.Tensor, dst: torch.Tensor,
         seconds: float) -> tuple[float, float]:
    pin = device.type == "cuda"
    if kind == "python":
        ring = bounce._Ring(256 << 20, chunk, threads, device, pin=pin)
    else:
        ring = bounce._NativeRing(256 << 20, chunk, threads, device, pin, streamcopy.load_ring()[0],
                                  host_bytes=src.numel(), units=1)
    stream = torch.cuda.Stream(device) if pin else None
    stop, moved = threading.Event(), [0]

    def mover() -> None:
        while not stop.is_set():
            job = ring.request(src)
            if stream is not None:
                with torch.cuda.stream(stream):
                    ring.copy(job, dst, stream)
                stream.synchronize()
            else:
                ring.copy(job, dst, None)
            moved[0] += src.numel()

    th = threading.Thread(target=mover, daemon=True)
    t0 = time.perf_counter()
    th.start()
    rate = _load_rate(seconds)
    stop.set()
    th.join()
    gbps = moved[0] / (time.perf_counter() - t0) / 1e9
    ring.close()
    return rate, gbps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ring_gil", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--chunks-mib", default="16")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    lib, why = streamcopy.load_ring()
    kinds = ["python"] + (["native"] if lib is not None else [])
    if lib is None:
        print(f"(the native ring does not build here: {why})")
    src = torch.empty(512 << 20, dtype=torch.uint8).fill_(3)
    dst = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    alone = _load_rate(args.seconds)
    print(f"engine-like thread alone: {alone:,.0f} ops/s ({device})")
    for c in (int(x) for x in args.chunks_mib.split(",")):
        for th in (int(x) for x in args.threads.split(",")):
            for kind in kinds:
                rate, gbps = _run(kind, th, c << 20, device, src, dst, args.seconds)
                print(f"{kind:7s} ring, {th:2d} threads, {c:3d} MiB chunks: engine-like thread {rate / alone:5.2f}x "
                      f"its rate alone, ring {gbps:6.2f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
