"""The fused FP8 block kernel's build variants on one GPU, against one device copy of the same
weights, measured in the same run (CUDA events, device time; median of ``--reps``).

    python benchmarks/bench_fp8_kernel.py [--shape llama3-8b] [--reps 5]

Every FP8 weight of the shape (bf16, block 128x128, float32 scales) goes through ONE launch
per variant (``trainer.fp8_cuda``'s table), so the rows time the kernel alone, without a
round's per-group host work (``bench_fp8.py`` times that). Variants: ``-DWW_HW_CVT=0`` (the
integer e4m3 rounding on every device) or ``1`` (the hardware pair conversion on sm_89+),
``-DWW_MIN_BLOCKS=n`` (``__launch_bounds__``' resident blocks per SM). The ``bytes`` column
compares each variant's weights and scales with the first row's (integer rounding,
checked against vLLM's reference on the CPU lane) byte for byte.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

VARIANTS = [
    ("int rounding, 1 block/SM bound", ("-DWW_HW_CVT=0", "-DWW_MIN_BLOCKS=1")),
    ("hw pair cvt, 1 block/SM bound", ("-DWW_HW_CVT=1", "-DWW_MIN_BLOCKS=1")),
    ("hw pair cvt, 2 blocks/SM", ("-DWW_HW_CVT=1", "-DWW_MIN_BLOCKS=2")),
    ("hw pair cvt, 3 blocks/SM (the default)", ("-DWW_HW_CVT=1", "-DWW_MIN_BLOCKS=3")),
    ("hw pair cvt, 4 blocks/SM", ("-DWW_HW_CVT=1", "-DWW_MIN_BLOCKS=4")),
    ("int rounding, 3 blocks/SM", ("-DWW_HW_CVT=0", "-DWW_MIN_BLOCKS=3")),
]


def _weights(shape: str) -> dict[str, Any]:
    import torch

    from weightwire.tools.bench.sync_models import MODELS, hf_shapes

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, dims in hf_shapes(MODELS[shape]):
        if len(dims) == 2 and "embed" not in name and "lm_head" not in name:
            x = torch.randn(dims, generator=gen, device="cuda", dtype=torch.float32)
            out[name] = x.to(torch.bfloat16)
    return out


def _events_ms(fn: Any, reps: int) -> float:
    import torch

    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from weightwire.trainer import fp8_cuda

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    weights = _weights(args.shape)
    nbytes = sum(x.numel() * x.element_size() for x in weights.values())
    outs = {
        n: (
            torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda"),
            torch.empty((-(-x.shape[0] // 128), -(-x.shape[1] // 128)), device="cuda"),
            torch.empty((-(-x.shape[0] // 128), -(-x.shape[1] // 128)), device="cuda"),
        )
        for n, x in weights.items()
    }
    jobs = [
        fp8_cuda.BlockJob(
            x.data_ptr(), outs[n][0].data_ptr(), outs[n][1].data_ptr(), outs[n][2].data_ptr(),
            x.shape[0], x.shape[1], x.stride(0), "bfloat16", (128, 128), False,
        )
        for n, x in weights.items()
    ]  # fmt: skip
    table, tiles = fp8_cuda.block_table(jobs)
    on_device = torch.from_numpy(table).to("cuda")
    stream = int(torch.cuda.current_stream().cuda_stream)
    copies = {n: torch.empty_like(x) for n, x in weights.items()}

    def copy() -> None:
        for n, x in weights.items():
            copies[n].copy_(x)

    copy_ms = _events_ms(copy, args.reps)
    print(f"{len(weights)} weights, {nbytes / 1e9:.2f} GB bf16, {tiles} tiles", flush=True)
    rows = [f"| one device copy of the weights | {copy_ms:.2f} | 1.00x | - |"]
    want: list[bytes] | None = None
    for label, defines in VARIANTS:
        try:
            kernels = fp8_cuda.Fp8Kernels(0, defines)
        except Exception as exc:  # a variant that does not build is a row, not the end
            rows.append(f"| {label} | - | - | {type(exc).__name__}: {str(exc)[:80]} |")
            continue

        def run(k: Any = kernels) -> None:
            k.launch("bfloat16", on_device.data_ptr(), len(jobs), tiles, stream)

        for o in outs.values():
            o[0].view(torch.uint8).zero_()
        ms = _events_ms(run, args.reps)
        torch.cuda.synchronize()
        got = [
            o[i].cpu().view(torch.uint8).numpy().tobytes() for o in outs.values() for i in (0, 1)
        ]
        same = "reference" if want is None else ("same" if got == want else "DIFFER")
        want = got if want is None else want
        rows.append(f"| {label} | {ms:.2f} | {ms / copy_ms:.2f}x | {same} |")
        print(rows[-1], flush=True)
    print("| kernel variant | device ms | x one copy | bytes |\n|---|---:|---:|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
