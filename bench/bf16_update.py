"""Benchmark: a bf16 update against an fp32 one on Gemma 3 270M's shapes, on this CPU.

.venv/bin/python bench/bf16_update.py [--tokens 512] [--repeats 3] [--threads 1]

TRL's bf16 backward was seen at 100% of one core in torch's reference GEMM
(`MmBackward0` -> `addmm_impl_cpu_` -> `cpublas_gemm_impl`) on a CPU without native bf16
(no AVX512-BF16 / AMX): the issue asks whether pipe's own bf16 path falls into it. Each row
times one forward and backward of a layer with Gemma 3 270M's shapes over `--tokens` tokens:
the output head (640 -> 262,144, what a tied embedding trains through), an MLP projection
(640 -> 2,048) and its way back (2,048 -> 640), in fp32 and in bf16 (weights and inputs in the
dtype, as DeepSpeed's bf16 module holds them), taking turns, the best of `--repeats`. Ratios
above 1 mean bf16 is slower. BENCHMARKS.md records the figures ("bf16 on a CPU without bf16").
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def timed(layer: object, x: object, repeats: int) -> float:
    import torch

    best = float("inf")
    for _ in range(repeats):
        inp = x.detach().requires_grad_()  # type: ignore[attr-defined]
        start = time.perf_counter()
        out = layer(inp)  # type: ignore[operator]
        out.float().sum().backward()
        best = min(best, time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    del torch
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text(encoding="utf-8") if cpuinfo.exists() else ""
    native = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    print(
        f"# torch {torch.__version__}, {args.threads} thread(s), {args.tokens} tokens; "
        f"CPU flags: {' '.join(native) or 'none of avx2/avx512/amx'}",
        flush=True,
    )
    torch.manual_seed(0)
    shapes = [
        ("output head 640 -> 262144", 640, 262144),
        ("MLP 640 -> 2048", 640, 2048),
        ("MLP 2048 -> 640", 2048, 640),
    ]
    print(f"{'layer':<28} {'fp32 s':>8} {'bf16 s':>8} {'bf16/fp32':>10}")
    for name, n_in, n_out in shapes:
        layer = torch.nn.Linear(n_in, n_out, bias=False)
        x = torch.randn(args.tokens, n_in)
        fp32 = timed(layer, x, args.repeats)
        layer = layer.to(torch.bfloat16)
        bf16 = timed(layer, x.to(torch.bfloat16), args.repeats)
        print(f"{name:<28} {fp32:>8.3f} {bf16:>8.3f} {bf16 / fp32:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
