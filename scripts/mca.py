#!/usr/bin/env python3
"""Predicted cycles of the batched kernels' inner loops on CPUs we may not have, with llvm-mca.

Compiles bench/mca/tiles.cpp to assembly per instruction set (the flags src/CMakeLists.txt gives
the kernel files), cuts out each function's hottest innermost loop (the loop with the most FMAs),
and runs llvm-mca on it for each CPU model that can run that instruction set. Prints a Markdown
table: cycles per loop iteration, FMAs per iteration, FMAs per cycle against the CPU's peak.
Usage: scripts/mca.py [--mca llvm-mca-16] [--cxx g++]   (Debian: apt-get install llvm-16)
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ISAS = {  # name: (xsimd arch, compiler flags as src/CMakeLists.txt sets them, CPU models that run it)
    "avx2": ("xsimd::avx2", ["-mavx2", "-mfma"], ["znver3", "znver4", "sapphirerapids"]),
    "avx512": ("xsimd::avx512f", ["-mavx512f", "-mavx512dq", "-mavx2", "-mfma"], ["znver4", "sapphirerapids"]),
}
# Vector FMAs a core retires per cycle at each width (from the vendors' optimisation manuals):
# Zen 3 has two 256-bit FMA pipes and no AVX-512; Zen 4 runs a 512-bit FMA as two 256-bit halves
# on the same two pipes; Sapphire Rapids has two 512-bit FMA ports (ports 0 and 5).
PEAK = {("znver3", 256): 2, ("znver4", 256): 2, ("znver4", 512): 1, ("sapphirerapids", 256): 2, ("sapphirerapids", 512): 2}
FUNCS = ["mca_scores_tile", "mca_blend_tile", "mca_exp_columns"]
WHAT = {
    "mca_scores_tile": "batch: score tile",
    "mca_blend_tile": "batch: blend tile",
    "mca_exp_columns": "batch: exp down columns",
}


def functions(asm):
    """{symbol: [lines]} of every function in GCC's assembly."""
    out, name = {}, None
    for line in asm.splitlines():
        m = re.match(r"^([A-Za-z_.$][\w.$]*):\s*$", line)
        if m and not m.group(1).startswith(".L"):
            name = m.group(1)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


def body_of(funcs, name):
    """A function's lines, following a tail call (jmp symbol) to the template it forwards to."""
    lines = funcs[name]
    code = [l.strip() for l in lines if l.strip() and not l.strip().startswith(".")]
    if len(code) == 1 and code[0].startswith("jmp"):
        return funcs[code[0].split()[1]]
    return lines


def innermost_loop(lines):
    """The instructions of the innermost loop with the most FMAs (ties: the shortest). A loop runs
    from a label to a later jump back to it; it is innermost if it holds no other such loop."""
    labels, loops = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^(\.L\w+):", line.strip())
        if m:
            labels[m.group(1)] = i
        m = re.match(r"^\s*j\w+\s+(\.L\w+)", line)
        if m and m.group(1) in labels:
            loops.append((labels[m.group(1)], i))
    best = None
    for start, end in loops:
        if any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops):
            continue
        block = [l.strip() for l in lines[start + 1:end + 1] if l.strip() and not l.strip().startswith(".")]
        fmas = sum(("vfmadd" in l or "vfnmadd" in l) for l in block)
        if best is None or (fmas, -len(block)) > (best[0], -len(best[1])):
            best = (fmas, block)
    return best


def mca(mcabin, cpu, block):
    with tempfile.NamedTemporaryFile("w", suffix=".s") as f:
        f.write("\n".join(block) + "\n")
        f.flush()
        out = subprocess.run([mcabin, "-mtriple=x86_64-linux-gnu", f"-mcpu={cpu}", "-iterations=200", f.name],
                             capture_output=True, text=True, check=True).stdout
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    return cycles / 200.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mca", default="llvm-mca-16")
    ap.add_argument("--cxx", default="g++")
    args = ap.parse_args()
    rows = []
    for isa, (arch, flags, cpus) in ISAS.items():
        width = 512 if isa == "avx512" else 256
        asm = subprocess.run([args.cxx, "-std=c++20", "-O3", "-DNDEBUG", "-S", "-o", "-", f"-I{ROOT / 'src'}",
                              f"-DSOFTKV_MCA_ARCH={arch}", *flags, str(ROOT / "bench/mca/tiles.cpp")],
                             capture_output=True, text=True, check=True).stdout
        funcs = functions(asm)
        for fn in FUNCS:
            fmas, block = innermost_loop(body_of(funcs, fn))
            for cpu in cpus:
                per_iter = mca(args.mca, cpu, block)
                peak = PEAK[(cpu, width)]
                rows.append((WHAT[fn], isa, cpu, len(block), fmas, per_iter, fmas / per_iter / peak if fmas else None))
    print("| loop | path | CPU model | instructions | FMAs | cycles / iteration | FMA ports busy |")
    print("|---|---|---|---|---|---|---|")
    for what, isa, cpu, n, fmas, cyc, busy in rows:
        print(f"| {what} | {isa} | {cpu} | {n} | {fmas} | {cyc:.2f} | {'-' if busy is None else f'{100 * busy:.0f}%'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
