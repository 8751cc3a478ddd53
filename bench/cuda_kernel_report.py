"""Compile kiln's custom CUDA decode-attention kernels with nvcc, no GPU needed, and print
ptxas's resource report (registers, spills, stack, shared memory) for each variant.

    python bench/cuda_kernel_report.py [--cuda /usr/local/cuda-13.0] [--arch sm_90] [--stages 0,4]

(a CUDA toolkit; without one, pip install --target /tmp/cuda "nvidia-cuda-nvcc==13.0.*"
"nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*" and pass
--cuda /tmp/cuda/nvidia/cu13)

MLX compiles these sources at run time (NVRTC) inside its own wrapper; this script wraps
the same bodies (worker_proc.paged_attention) in a kernel of the same parameters, so a
syntax error, a spill to local memory (arrays the compiler could not keep in registers)
or a register count that caps occupancy shows here before a GPU call is spent on it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_proc import paged_attention as pa  # noqa: E402
from worker_proc.kernel_constants import float_bits  # noqa: E402
from worker_proc import (expert_rows, fused_moe, paged_prefill, qk_norm_rope,  # noqa: E402
                         readback, residual_norm)

# Each input's element type in the kernels (T: q's dtype; P: the pool's).
_TYPES = {"q": "T", "k_new": "T", "v_new": "T", "qkv": "T", "kv_pool": "P", "table": "int32_t",
          "lengths": "int32_t", "written": "int32_t", "slots": "int32_t",
          "rope": "float", "sinks": "T", "acc": "float", "ml": "float", "out": "T", "out_ml": "float",
          "mark": "int32_t", "bias": "T", "qk_scale": "T",
          "branch": "T", "residual": "T", "weight": "T", "next_weight": "T",
          "normed": "T", "starts": "int32_t",
          "logits": "T", "weights": "T", "experts": "uint32_t", "rows": "uint32_t",
          "places": "uint32_t", "down": "T", "router_bias": "T", "x": "T",
          "tokens": "uint32_t", "packed": "uint32_t", "exponents": "uint8_t", "scales": "T",
          "biases": "T", "dst": "int32_t", "src": "int32_t", "done": "int32_t"}


def _bits(x: float) -> str:
    """A float template argument as the kernels take it (kernel_constants.float_bits)."""
    return str(float_bits(x))


def wrap(name: str, inputs: list[str], outputs: list[str], body: str, header: str,
         params: dict[str, str]) -> str:
    """A .cu file: the body as a kernel of MLX's wrapper's parameters (each input a const
    pointer with its shape and strides; outputs plain pointers), its template arguments
    given as file-scope types and constants."""
    args = []
    for x in inputs:
        args += [f"const {_TYPES[x]}* {x}", f"const int32_t* {x}_shape",
                 f"const int64_t* {x}_strides", f"int {x}_ndim"]
    args += [f"{_TYPES[x]}* {x}" for x in outputs]
    consts = "".join(f"using {k} = {v};\n" if v.startswith("__") or v == "float"
                     else f"constexpr auto {k} = {v};\n" for k, v in params.items())
    return (f"#include <cuda_bf16.h>\n#include <cstdint>\n{consts}{header}\n"
            f"__global__ void {name}({', '.join(args)}) {{\n{body}\n}}\n")


def variants(dtype: str, dim: int, group: int, n_kv: int, lanes: int, passes: int,
             stages: int = 0, mma: pa.MmaConfig | None = None,
             warp_tiles: bool = pa.DEFAULT_WARP_TILES) -> list[tuple[str, str]]:
    """(label, .cu source) of every decode kernel as the served model launches it (mma:
    the tensor-core kernels of that shape, whose lanes, passes and stages are their own)."""
    out = []
    for direct in (True, False):
        outputs = ["out"] if direct else ["out", "out_ml"]
        kinds = [("read", False, False, False), ("write", True, False, False),
                 ("write_qkv_rope", True, True, False)]
        if direct:  # with GPT-OSS's sinks, one split (several take them in the merge)
            kinds += [("read_sinks", False, False, True), ("write_sinks", True, False, True)]
        for label, write_new, fused, sinks in kinds:
            new = (["qkv"] if fused else ["q", "k_new", "v_new"]) if write_new else ["q"]
            inputs = [*new, "kv_pool", "table", "lengths", "written"]
            params = {"T": dtype, "D": str(dim), "G": str(group), "HKV": str(n_kv), "P": dtype,
                      "CHUNK_MAX": str(pa.MAX_SPLIT_TOKENS), "SCALE": _bits(dim ** -0.5)}
            if mma:
                layout = mma.layout(dim)
                params |= {"TOKEN_WARPS": str(layout.token_warps),
                           "COLUMN_WARPS": str(layout.column_warps), "STAGES": str(layout.stages)}
            else:
                params |= {"LANES": str(lanes), "PASSES": str(passes)}
            if stages and not mma:
                params["STAGES"] = str(stages)
            outs = list(outputs)
            if write_new:
                inputs.append("slots")
                outs.append("mark")
            if fused:
                inputs.append("rope")
                params |= {"ROPE_TRADITIONAL": "false", "ROPE_FREQS": "true"}
            if sinks:
                inputs.append("sinks")
            if mma:
                dynamic = mma.dynamic_bytes(dim, group) > 0
                name = f"kiln_{label}_{'direct' if direct else 'split'}_mma{'_dyn' if dynamic else ''}"
                source = pa._mma_source(direct, write_new, fused, sinks, dynamic)
                header = pa._HEADER + pa._MMA_HEADER
            else:
                warped = warp_tiles and stages > 0
                name = (f"kiln_{label}_{'direct' if direct else 'split'}_l{lanes}_u{passes}"
                        + (f"_s{stages}" if stages else "") + ("w" if warped else ""))
                source = pa._source(direct, write_new, fused, stages > 0, sinks, warped)
                header = pa._HEADER
            out.append((name, wrap(name, inputs, outs, source,
                                   header + (pa._ROPE_HEADER if fused else ""), params)))
    return out


def merge_variant(dtype: str, dim: int, group: int, n_kv: int,
                  sinks: bool = False) -> tuple[str, str]:
    """(label, .cu source) of the kernel that merges a row's splits (with sinks: GPT-OSS)."""
    params = {"T": dtype, "D": str(dim), "G": str(group), "HKV": str(n_kv)}
    name = "kiln_merge" + ("_sinks" if sinks else "")
    return name, wrap(name, ["acc", "ml", *(["sinks"] if sinks else [])], ["out"],
                      pa.merge_source(sinks), pa._HEADER, params)


def readback_variant() -> tuple[str, str]:
    """(label, .cu source) of the copy into a readback ring (worker_proc.readback)."""
    return "kiln_readback", wrap("kiln_readback", ["dst", "src"], ["done"], readback.SOURCE,
                                 "", {})


def qk_norm_variants(dtype: str, dim: int, heads: int) -> list[tuple[str, str]]:
    """(label, .cu source) of the decode step's q/k norm and RoPE kernel
    (worker_proc.qk_norm_rope), each RoPE layout and frequency source, and RoPE alone."""
    out = []
    for norm, trad, freqs in itertools.product((True, False), repeat=3):
        mscale = freqs and not norm  # YaRN's (GPT-OSS): frequencies given, input scaled
        name = (f"kiln_qk{'_norm' if norm else ''}_rope_d{dim}{'_trad' if trad else ''}"
                f"{'_freqs' if freqs else ''}{'_mscale' if mscale else ''}")
        params = {"T": dtype, "D": str(dim), "H": str(heads), "TRAD": str(trad).lower(),
                  "FREQS": str(freqs).lower(), "EPS": _bits(1e-6),
                  "MSCALE": _bits(1.35 if mscale else 1.0)}
        inputs = ["qkv", *(["qk_scale"] if norm else []), "rope", "lengths"]
        out.append((name, wrap(name, inputs, ["out"], qk_norm_rope.source(norm),
                               pa._ROPE_HEADER, params)))
    return out


def residual_norm_variants(dtype: str, dim: int) -> list[tuple[str, str]]:
    """(label, .cu source) of the sandwich-norm kernel (worker_proc.residual_norm), with
    and without the sum's own norm."""
    out = []
    for next_norm in (False, True):
        name = f"kiln_residual_norm_d{dim}{'_next' if next_norm else ''}"
        params = {"T": dtype, "D": str(dim), "BLOCK": str(residual_norm.block_threads(dim)),
                  "CLIP": "true" if dtype == "__half" else "false", "EPS": _bits(1e-6)}
        out.append((name, wrap(name, ["branch", "residual", "weight",
                                      *(["next_weight"] if next_norm else [])],
                               ["out", *(["normed"] if next_norm else [])],
                               residual_norm.source(next_norm), residual_norm.BLOCK_SUM_HEADER, params)))
    for bias in (True, False):  # the plain add and norm (GPT-OSS's)
        name = f"kiln_add_norm_d{dim}{'_bias' if bias else ''}"
        params = {"T": dtype, "D": str(dim), "BLOCK": str(residual_norm.block_threads(dim)),
                  "EPS": _bits(1e-5)}
        out.append((name, wrap(name, residual_norm.add_norm_inputs(bias), ["out", "normed"],
                               residual_norm.add_norm_source(bias), residual_norm.BLOCK_SUM_HEADER,
                               params)))
    return out


def moe_variants(dtype: str, experts: int, top_k: int, dim: int, padded: int
                 ) -> list[tuple[str, str]]:
    """(label, .cu source) of the mixture-of-experts kernels (worker_proc.fused_moe): the
    routing, top k first and softmax first, and the weighted sum with and without the
    down bias and the residual."""
    out = []
    for first, normalize, bias in ((False, False, True), (True, True, False)):
        name = (f"kiln_moe_route_e{experts}_k{top_k}{'_softmax_first' if first else ''}"
                f"{'_bias' if bias else ''}")
        params = {"T": dtype, "E": str(experts), "K": str(top_k),
                  "SOFTMAX_FIRST": str(first).lower(), "NORMALIZE": str(normalize).lower(),
                  "BLOCK": str(fused_moe.ROUTE_THREADS)}
        out.append((name, wrap(name, fused_moe.route_inputs(bias),
                               ["weights", "experts", "rows", "places"],
                               fused_moe.route_source(bias), fused_moe._HEADER, params)))
    for bias, residual, norm in ((True, True, True), (True, True, False), (False, False, False)):
        name = (f"kiln_moe_combine_d{dim}{'_bias' if bias else ''}"
                f"{'_residual' if residual else ''}{'_norm' if norm else ''}")
        params = {"T": dtype, "D": str(dim), "DP": str(padded), "K": str(top_k),
                  "BLOCK": str(fused_moe.COMBINE_THREADS), "EPS": _bits(1e-5)}
        out.append((name, wrap(name, fused_moe.combine_inputs(bias, residual, norm),
                               fused_moe.combine_outputs(norm),
                               fused_moe.combine_source(bias, residual, norm),
                               fused_moe._HEADER, params)))
    return out


def expert_rows_variants(dim: int, outs: int, per_warp: tuple[int, ...] = (expert_rows.TILES,)
                         ) -> list[tuple[str, str]]:
    """(label, .cu source) of the experts' projection kernel (worker_proc.expert_rows,
    bfloat16 rows): MXFP4 and affine weights at each count of output tiles a warp (TILES),
    rows gathered by token, in pair order and a quantized Linear's (linear_rows); bfloat16
    weights in both forms, rows gathered and in pair order."""
    out = []
    forms = ((True, False), (False, False), (False, True))  # (gather, a Linear's rows)
    for mode, (gather, linear), tiles in itertools.product(("mxfp4", "affine"), forms, per_warp):
        kind = "_gather" if gather else "_linear" if linear else ""
        name = f"kiln_expert_rows_{mode}_k{dim}_n{outs}_t{tiles}{kind}"
        params = {"T": "__nv_bfloat16", "KD": str(dim), "N": str(outs),
                  "GROUP": "32" if mode == "mxfp4" else "64",
                  "WARPS": str(expert_rows.WARPS), "TILES": str(tiles),
                  "ROW_TILES": str(expert_rows.ROW_TILES), "CHUNK": str(expert_rows.CHUNK)}
        out.append((name, wrap(name, expert_rows.inputs(mode, gather, linear), ["out"],
                               expert_rows.source(mode, gather, linear), expert_rows.header(),
                               params)))
    for mode, gather in itertools.product(("bf16", "bf16_staged"), (True, False)):
        name = f"kiln_expert_rows_{mode}_k{dim}_n{outs}{'_gather' if gather else ''}"
        params = {"T": "__nv_bfloat16", "KD": str(dim), "N": str(outs),
                  "WARPS": str(expert_rows.WARPS), "ROW_TILES": str(expert_rows.ROW_TILES),
                  "STAGES": str(expert_rows.STAGES)}
        out.append((name, wrap(name, expert_rows.inputs(mode, gather), ["out"],
                               expert_rows.source(mode, gather), expert_rows.header(mode), params)))
    return out


def bf16_linear_rows_variant(dim: int, outs: int) -> tuple[str, str]:
    """(label, .cu source) of a bfloat16 Linear's rows through the experts' kernel
    (expert_rows.linear_rows: the staged form at its most rows a pass, 64)."""
    name = f"kiln_expert_rows_bf16_staged_k{dim}_n{outs}_linear"
    params = {"T": "__nv_bfloat16", "KD": str(dim), "N": str(outs),
              "WARPS": str(expert_rows.WARPS), "ROW_TILES": "8", "STAGES": str(expert_rows.STAGES)}
    return (name, wrap(name, expert_rows.inputs("bf16_staged", False, True), ["out"],
                       expert_rows.source("bf16_staged", False, True),
                       expert_rows.header("bf16_staged"), params))


def latent_variants(dtype: str, dim: int, heads: int,
                    config: pa.LatentConfig = pa.LatentConfig()) -> list[tuple[str, str]]:
    """(label, .cu source) of the latent (MLA) decode kernels, one split and several."""
    params = {"T": dtype, "P": dtype, "D": str(dim), "H": str(heads),
              "WARPS": str(config.warps), "STAGES": str(config.stages),
              "CHUNK_MAX": str(pa.MAX_SPLIT_TOKENS), "SCALE": _bits(dim ** -0.5)}
    inputs = ["q", "kv_pool", "table", "lengths", "bias", "written"]
    out = []
    for direct in (True, False):
        name = f"kiln_latent_{'direct' if direct else 'split'}_w{config.warps}_s{config.stages}"
        source = pa._LATENT_BODY.replace(
            "WRITE", pa._LATENT_DIRECT_WRITE if direct else pa._LATENT_SPLIT_WRITE)
        out.append((name, wrap(name, inputs, ["out"] if direct else ["out", "out_ml"], source,
                               pa._HEADER + pa._MMA_HEADER, params)))
    return out


def prefill_variants(dtype: str, dim: int, group: int, n_kv: int) -> list[tuple[str, str]]:
    """(label, .cu source) of the paged prefill kernel (worker_proc.paged_prefill): full
    attention, a window, and sinks."""
    out = []
    for window, sinks in ((0, False), (1024, False), (128, True)):
        name = f"kiln_paged_prefill_d{dim}_w{window}{'_sinks' if sinks else ''}"
        params = {"T": dtype, "P": dtype, "D": str(dim), "G": str(group), "HKV": str(n_kv),
                  "TILE": str(paged_prefill.tile_tokens(dim)), "WARPS": str(paged_prefill.WARPS),
                  "STAGES": str(paged_prefill.STAGES), "WINDOW": str(window), "SCALE": _bits(dim ** -0.5)}
        inputs = ["q", "kv_pool", "table", "starts", "written", *(["sinks"] if sinks else [])]
        out.append((name, wrap(name, inputs, ["out"], paged_prefill.source(sinks),
                               paged_prefill.HEADER, params)))
    return out


@dataclass(frozen=True)
class Compiled:
    name: str
    ok: bool
    report: str  # ptxas's resource lines, or the compiler's errors
    source: str


def compile_kernels(cuda: Path, kernels: list[tuple[str, str]], arch: str = "sm_90") -> list[Compiled]:
    """Compile each (name, source) to a cubin as MLX would (NVRTC takes no fast-math flag
    from MLX: neither does this), collecting ptxas's resource report.

    The kernels go to nvcc in one translation unit per core, each in a namespace of its
    own (variants share names and file-scope constants): nvcc's header parsing, most of
    a small kernel's compile, is then paid once a unit. ptxas allocates each function on
    its own, so the reports are those of separate files. A unit that fails is compiled
    again a kernel a file, so each error names its kernel."""
    batches = [list(range(len(kernels)))[i::os.cpu_count() or 1] for i in
               range(min(len(kernels), os.cpu_count() or 1))]
    results: list[Compiled | None] = [None] * len(kernels)
    with tempfile.TemporaryDirectory() as tmp:
        def compile_batch(at: int, members: list[int]) -> None:
            run = _nvcc(cuda, arch, Path(tmp) / f"unit_{at}.cu",
                        _translation_unit([kernels[i][1] for i in members]))
            reports = _entry_reports(run.stderr)
            if run.returncode == 0 and len(reports) == len(members):
                for slot, i in enumerate(members):
                    results[i] = Compiled(kernels[i][0], True, reports[slot], kernels[i][1])
                return
            for i in members:  # find which kernel failed, and why
                name, source = kernels[i]
                alone = _nvcc(cuda, arch, Path(tmp) / f"alone_{i}.cu", source)
                report = "; ".join(_entry_reports(alone.stderr))
                results[i] = Compiled(name, alone.returncode == 0,
                                      report if alone.returncode == 0 else alone.stderr[-3000:],
                                      source)

        # One nvcc per core: each is a single-threaded process.
        with ThreadPoolExecutor(max_workers=len(batches) or 1) as pool:
            list(pool.map(compile_batch, range(len(batches)), batches))
    return [r for r in results if r is not None]


def _nvcc(cuda: Path, arch: str, cu: Path, source: str) -> subprocess.CompletedProcess:
    # CCCL's headers (nv/target, which cuda_fp16.h includes) sit in include/cccl in
    # the toolkit, in include/ itself in the pip wheels.
    includes = [f"-I{d}" for d in (cuda / "include", cuda / "include" / "cccl") if d.is_dir()]
    cu.write_text(source)
    return subprocess.run([str(cuda / "bin" / "nvcc"), f"-arch={arch}", "-cubin", "-O3",
                           "-Xptxas", "-v", *includes, "-o", str(cu.with_suffix(".cubin")),
                           str(cu)], capture_output=True, text=True)


def _translation_unit(sources: list[str]) -> str:
    """The sources as one file: their #include lines once at the top, the rest of the
    i-th in namespace k<i>."""
    includes: list[str] = []
    bodies = []
    for i, source in enumerate(sources):
        lines = source.splitlines()
        includes += [ln for ln in lines if ln.startswith("#include") and ln not in includes]
        body = "\n".join(ln for ln in lines if not ln.startswith("#include"))
        bodies.append(f"namespace k{i} {{\n{body}\n}}  // namespace k{i}\n")
    return "\n".join(includes) + "\n" + "".join(bodies)


def _entry_reports(stderr: str) -> list[str]:
    """ptxas's resource lines per entry function, in the order of their namespaces k<i>
    (ptxas reports functions in no set order)."""
    reports: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in stderr.splitlines():
        if "Compiling entry function" in line:
            current = reports.setdefault(_namespace_index(line.split("'")[1]), [])
        elif current is not None and ("Used" in line or "stack frame" in line):
            current.append(line.split(":", 1)[-1].strip())
    return ["; ".join(reports[at]) for at in sorted(reports)]


def _namespace_index(mangled: str) -> int:
    """i of a function in namespace k<i> (`_ZN2k3...`: the name's length, then the name;
    the function's own length follows it); 0 outside any (a file of one)."""
    match = re.match(r"_ZN(\d+)k", mangled)
    if match is None:
        return 0
    digits = int(match.group(1)) - 1  # the name's characters after "k"
    return int(mangled[match.end():match.end() + digits])


def find_cuda() -> Path | None:
    """A CUDA toolkit with nvcc: $CUDA_HOME, else the newest /usr/local/cuda*."""
    home = os.environ.get("CUDA_HOME")
    candidates = [Path(home)] if home else sorted(Path("/usr/local").glob("cuda*"), reverse=True)
    return next((c for c in candidates if (c / "bin" / "nvcc").is_file()), None)


def kernel_shapes(text: str) -> list[tuple[int, int]]:
    """argparse type: kernel shapes, lanes a token x passes, comma-separated ("16x1,32x4")."""
    return [(int(lanes), int(passes)) for lanes, passes in (s.split("x") for s in text.split(","))]


def stage_counts(text: str) -> list[int]:
    """argparse type: the kernel's stages values, comma-separated ("0,4,8")."""
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", type=Path, default=find_cuda(),
                   help="CUDA root: bin/nvcc, include/ (default: $CUDA_HOME or /usr/local/cuda*)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--dtype", default="__nv_bfloat16")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--shapes", type=kernel_shapes, default=None,
                   help="lanes a token x passes, comma-separated: 32x4,16x2 (default: as served "
                        "for --head-dim)")
    p.add_argument("--stages", type=stage_counts, default=[pa.DEFAULT_STAGES],
                   help="staged-pipeline tiles, comma-separated (0: register prefetch)")
    p.add_argument("--block-tiles", action="store_true",
                   help="the staged pipeline's tiles copied by the whole block (--experiments "
                        "block-tiles), not a warp's slice each")
    p.add_argument("--mma", action="store_true", help="the tensor-core kernels too")
    p.add_argument("--mma-stage-kib", type=int, default=pa.MmaConfig.stage_bytes // 1024,
                   help="with --mma: the tiles' shared memory in KiB (past 48 with the rest: "
                        "dynamic shared memory)")
    p.add_argument("--mma-stages", type=int, default=pa.MmaConfig.stages, help="with --mma")
    p.add_argument("--mma-warps", type=int, default=pa.MmaConfig.warps, help="with --mma")
    p.add_argument("--latent", type=int, default=0, metavar="HEADS",
                   help="the latent (MLA) kernels too, for this many query heads over a "
                        "--head-dim latent (DeepSeek-V3: 128 over 512)")
    p.add_argument("--latent-warps", type=int, default=pa.LatentConfig.warps)
    p.add_argument("--latent-stages", type=int, default=pa.LatentConfig.stages)
    p.add_argument("--prefill", action="store_true",
                   help="the paged prefill kernels too (--head-dim, --group, --kv-heads)")
    p.add_argument("--keep", type=Path, help="write the .cu files here too")
    args = p.parse_args()
    if args.shapes is None:  # as served: wide heads take either lanes, by the launch's rows
        lanes = {pa.lanes_per_token(args.head_dim, args.group, rows) for rows in (0, 1 << 20)}
        args.shapes = [(n, pa.PASSES) for n in sorted(lanes, reverse=True)]
    if args.cuda is None:
        sys.exit("no CUDA toolkit found: pass --cuda")
    itemsize = 4 if args.dtype == "float" else 2
    kernels = []
    for (lanes, passes), stages in itertools.product(args.shapes, args.stages):
        # As served: the tiles that fit beside the rest of the block's shared memory.
        pa.LANES_PER_TOKEN = pa.WIDE_HEAD_LANES = lanes
        pa.PASSES = passes
        tiles = pa.staged_tiles(args.head_dim, itemsize, args.group, stages)
        kernels += variants(args.dtype, args.head_dim, args.group, args.kv_heads, lanes,
                            passes, tiles, warp_tiles=not args.block_tiles)
    if args.mma:
        mma = pa.MmaConfig(args.mma_stage_kib * 1024, args.mma_stages, args.mma_warps)
        kernels += variants(args.dtype, args.head_dim, args.group, args.kv_heads, 0, 0, mma=mma)
    if args.latent:
        kernels += latent_variants(args.dtype, args.head_dim, args.latent,
                                   pa.LatentConfig(args.latent_warps, args.latent_stages))
    if args.prefill:
        kernels += prefill_variants(args.dtype, args.head_dim, args.group, args.kv_heads)
    kernels.append(merge_variant(args.dtype, args.head_dim, args.group, args.kv_heads))
    kernels.append(merge_variant(args.dtype, args.head_dim, args.group, args.kv_heads, sinks=True))
    results = compile_kernels(args.cuda, kernels, args.arch)
    for r in results:
        print(f"{r.name:40s} " + (r.report if r.ok else "FAILED\n" + r.report))
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"{r.name}.cu").write_text(r.source)
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
