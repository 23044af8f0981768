"""Pageable weights to the GPU through a small pinned bounce ring: which fill and issue scheme is fastest.

    python -m bench.bounce_probe [--gib 4] [--ring-mib 256] [--modes memmove,stream,copy_,register] [--load]

Prints GB/s for: pinned H2D (the ceiling), pageable H2D (today's fallback), and the bounce ring
at several chunk sizes and fill-thread counts, with three fill kernels (libc memmove through ctypes,
which releases the GIL; the engine's streaming-store copy, offload_core/streamcopy.py; torch's copy_); `register` pins each chunk of the pageable source in place
(cudaHostRegister, at most the ring's bytes at a time) and copies from there: no host memcpy. `--load`
runs an engine-like thread of small torch ops beside each and prints its rate against it alone.
`--cores all,spare`: the copy threads on any CPU, or (spare) off the calling thread's core and its SMT
siblings, as OFFLOAD_BOUNCE_CORES=spare keeps the engine's (offload_core/bounce.py, _spare_cpus).

Measured on the H200 host (16 cores, 2026-12-04, 4 GiB of pageable weights, ring 256 MiB):
pinned H2D 55.3 GB/s, pageable H2D 7.5; the ring at 16 MiB chunks with 16 memmove threads 48.6 GB/s
(0.88x pinned), 8 MiB x 16 threads 45.5, 16 MiB x 8 threads 44.6; torch's copy_ peaks at 46.4
(32 MiB x 4 threads) and falls with more threads (its own intra-op threads compete); 64 MiB chunks
leave too few buffers in the ring to overlap fill and copy (22-39 GB/s).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def _rate(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


def pinned_h2d(src_pinned: torch.Tensor, dst: torch.Tensor, chunk: int) -> float:
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.cuda.stream(s):
        for o in range(0, src_pinned.numel(), chunk):
            dst[o: o + chunk].copy_(src_pinned[o: o + chunk], non_blocking=True)
    s.synchronize()
    return _rate(src_pinned.numel(), time.perf_counter() - t)


def pageable_h2d(src: torch.Tensor, dst: torch.Tensor, chunk: int) -> float:
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.cuda.stream(s):
        for o in range(0, src.numel(), chunk):
            dst[o: o + chunk].copy_(src[o: o + chunk], non_blocking=True)
    s.synchronize()
    return _rate(src.numel(), time.perf_counter() - t)


CPUS: set[int] | None = None  # --cores spare: the CPUs the copy threads keep to


def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, initializer=(lambda: os.sched_setaffinity(0, CPUS)) if CPUS else None)


def _stream_copy():
    """The engine's streaming-store fill (offload_core/streamcopy.py); an error where it does not build."""
    from offload_core import streamcopy

    fn, why = streamcopy.load()
    if fn is None:
        raise SystemExit(f"--modes stream: {why}")
    return fn


def bounce(src: torch.Tensor, dst: torch.Tensor, ring: int, chunk: int, threads: int, kernel: str) -> float:
    nbuf = max(ring // chunk, 2)
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
    n = src.numel()
    chunks = [(o, min(chunk, n - o)) for o in range(0, n, chunk)]
    filled = [threading.Event() for _ in chunks]
    recorded = [threading.Event() for _ in chunks]
    events: list = [None] * len(chunks)
    stream = torch.cuda.Stream()
    sp = src.data_ptr()

    def fill(i: int) -> None:
        o, m = chunks[i]
        if i >= nbuf:
            recorded[i - nbuf].wait()
            events[i - nbuf].synchronize()
        b = bufs[i % nbuf]
        if kernel == "memmove":
            ctypes.memmove(b.data_ptr(), sp + o, m)
        elif kernel == "stream":
            _stream_copy()(b.data_ptr(), sp + o, m)
        else:
            b[:m].copy_(src[o: o + m])
        filled[i].set()

    torch.cuda.synchronize()
    t = time.perf_counter()
    with _pool(threads) as pool:
        futs = [pool.submit(fill, i) for i in range(len(chunks))]
        with torch.cuda.stream(stream):
            for i, (o, m) in enumerate(chunks):
                filled[i].wait()
                dst[o: o + m].copy_(bufs[i % nbuf][:m], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                events[i] = ev
                recorded[i].set()
        stream.synchronize()
        for f in futs:
            f.result()
    return _rate(n, time.perf_counter() - t)


def register(src: torch.Tensor, dst: torch.Tensor, ring: int, chunk: int, threads: int) -> float:
    """No bounce buffers: each chunk of the pageable source is registered (pinned in place) by a thread,
    copied straight from there, and unregistered once its copy completes; at most ``ring`` bytes are
    registered at a time. No host memcpy: a byte is read once, by the DMA."""
    rt = torch.cuda.cudart()
    n = src.numel()
    chunks = [(o, min(chunk, n - o)) for o in range(0, n, chunk)]
    inflight = max(ring // chunk, 2)
    registered = [threading.Event() for _ in chunks]
    done = [threading.Event() for _ in chunks]
    events: list = [None] * len(chunks)
    stream = torch.cuda.Stream()
    sp = src.data_ptr()
    errors: list = []

    def reg(i: int) -> None:
        if i >= inflight:
            done[i - inflight].wait()  # its range unregistered: the budget has room again
        o, m = chunks[i]
        err = rt.cudaHostRegister(sp + o, m, 0)
        if int(err) != 0:
            errors.append(f"cudaHostRegister {err}")
        registered[i].set()

    def unreg(i: int) -> None:
        events[i].synchronize()
        o, _ = chunks[i]
        rt.cudaHostUnregister(sp + o)
        done[i].set()

    torch.cuda.synchronize()
    t = time.perf_counter()
    with _pool(threads) as pool, _pool(2) as unpool:
        futs = [pool.submit(reg, i) for i in range(len(chunks))]
        with torch.cuda.stream(stream):
            for i, (o, m) in enumerate(chunks):
                registered[i].wait()
                dst[o: o + m].copy_(src[o: o + m], non_blocking=True)
                ev = torch.cuda.Event(blocking=True)
                ev.record(stream)
                events[i] = ev
                unpool.submit(unreg, i)
        stream.synchronize()
        for f in futs:
            f.result()
    if errors:
        raise RuntimeError(errors[0])
    return _rate(n, time.perf_counter() - t)


class Load:
    """An engine-like thread beside the copies: small CPU torch ops in a loop (the dispatcher and the GIL,
    as the engine's own thread launching kernels); ``rate()`` is its ops per second."""

    def __init__(self) -> None:
        self.a, self.b = torch.randn(256), torch.randn(256)
        self.ops = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if CPUS:  # the engine's thread: on the core the copy threads keep off
            os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - CPUS)
        a, b = self.a, self.b
        while not self.stop.is_set():
            for _ in range(100):
                a = torch.add(a, b).mul_(0.5)
            self.ops += 200

    def __enter__(self) -> "Load":
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.s = time.perf_counter() - self.t0

    def rate(self) -> float:
        return self.ops / self.s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--ring-mib", type=int, default=256)
    ap.add_argument("--chunks-mib", default="4,8,16,32,64")
    ap.add_argument("--threads", default="4,8,16")
    ap.add_argument("--modes", default="memmove,stream,copy_",
                    help="memmove (libc), stream (the engine's streaming stores), copy_ (bounce buffers), register (pin in place)")
    ap.add_argument("--cores", default="all", help="all, spare, or both (all,spare): where the copy threads run")
    ap.add_argument("--load", action="store_true", help="run an engine-like thread of small torch ops beside each "
                    "config and print its rate against it alone (how much the copies slow the engine's own thread)")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 4096 * 4096
    raw = torch.empty(n + 4096, dtype=torch.uint8)  # page-aligned, so that registered chunks share no page
    src = raw[(-raw.data_ptr()) % 4096:][:n]
    src.fill_(7)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    pin = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    pin.fill_(3)
    dpin = dst[: pin.numel()]
    rows: list[tuple] = []
    rows.append(("pinned H2D 64MiB chunks", max(pinned_h2d(pin, dpin, 64 << 20) for _ in range(3))))
    rows.append(("pageable H2D 64MiB chunks", max(pageable_h2d(src, dst, 64 << 20) for _ in range(2))))
    ring = args.ring_mib << 20
    alone = None
    if args.load:
        with Load() as ld:
            time.sleep(2.0)
        alone = ld.rate()
    global CPUS
    from offload_core import bounce as ob

    combos = [(cores, kernel, c, th) for cores in args.cores.split(",")
              for kernel in [k.strip() for k in args.modes.split(",") if k.strip()]
              for c in [int(x) for x in args.chunks_mib.split(",")] for th in [int(x) for x in args.threads.split(",")]]
    for cores, kernel, c, th in combos:
        os.environ[ob.BOUNCE_CORES_ENV] = cores.strip()
        CPUS = ob._spare_cpus()
        if (ring // (c << 20)) < 2:
            continue
        dst.zero_()

        def once() -> float:
            # this thread issues the copies, as the engine's bounce-issue thread does: on the spare CPUs too,
            # leaving the excluded core to the engine-like thread (--load)
            everywhere = os.sched_getaffinity(0)
            if CPUS:
                os.sched_setaffinity(0, CPUS)
            try:
                if kernel == "register":
                    return register(src, dst, ring, c << 20, th)
                return bounce(src, dst, ring, c << 20, th, kernel)
            finally:
                os.sched_setaffinity(0, everywhere)

        load = ""
        if args.load:
            with Load() as ld:
                r = max(once() for _ in range(2))
            load = f"   engine-like thread at {ld.rate() / alone:.2f}x its rate alone"
        else:
            r = max(once() for _ in range(2))
        ok = torch.equal(dst[-4096:].cpu(), src[-4096:]) and torch.equal(dst[:4096].cpu(), src[:4096])
        name = "register in place" if kernel == "register" else f"bounce {kernel}"
        where = f" on {len(CPUS)} spare cpus" if CPUS else ""
        rows.append((f"{name} ring {args.ring_mib}MiB chunk {c}MiB threads {th}{where}{'' if ok else ' WRONG'}", r, load))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {n / 1e9:.2f} GB")
    for name, r, *load in rows:
        print(f"{name:60s} {r:7.2f} GB/s{load[0] if load else ''}")


if __name__ == "__main__":
    main()
