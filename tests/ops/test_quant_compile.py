"""Compile the quantized-matmul Triton kernels for sm_90 (H100/H200) without a GPU, as tests/ops/test_triton_compile.py
does for the Quest kernels: the interpreter misses compile-only errors (layouts of ``tl.split`` / ``tl.reshape``,
``tl.dot`` operand dtypes, constexpr globals). Every loop and format the launchers can pick, in bf16 (the engine's
dtype), with fp16 and fp32 once each; the batch-1 GEMVs must load their packed weights with 128-bit loads and not
spill, and the int4 GEMV (1 and 2 rows) must unpack its nibble pairs with one ``lop3`` each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent(
    """
    import os
    import subprocess
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from questkv.ops.triton import int4_gemv as qg
    from questkv.ops.triton import int4_words as qw
    from questkv.ops.triton import quant_matmul as qm

    def zero_dtype(dtype):  # int4 zero points as a QuantizedLinear holds round to nearest's: bytes beside bf16
        return "u8" if dtype == "bf16" else dtype

    TARGET = GPUTarget("cuda", 90, 32)
    KERNEL = qm._quant_matmul_kernel
    # integer arguments that are multiples of 16 at run time for the model shapes (specialised by a launch)
    DIVISIBLE = ("N", "K", "k_words", "words_per_split", "stride_xm", "stride_wn", "stride_sg", "stride_om")


    def ptxas_info(compiled):
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "kernel.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            result = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", ptx, "-o",
                                     os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
        lines = [line for line in result.stderr.splitlines() if "spill" in line or "Used" in line]
        return " ".join(line.split("info    : ")[-1] for line in lines)


    def compile_quant(method, cfg, dtype="bf16", group=128, even_k=True, bias=False):
        pointers = {"x_ptr": dtype, "w_ptr": "i32", "s_ptr": dtype, "bias_ptr": dtype, "part_ptr": "fp32",
                    "counter_ptr": "i32", "out_ptr": dtype}
        constexprs = dict(GROUP=qm._group(method, group), GROUP_SCALES=method != "int8",
                          GROUPS_PER_ITER=cfg.groups_per_iter, HAS_BIAS=bias, BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, SPLIT_K=cfg.split_k > 1, USE_DOT=cfg.use_dot, UPCAST=False,
                          IEEE=dtype == "fp32", EVEN_K=even_k, SWAP_AB=cfg.swap_ab)
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers else "i32"
                     for name in KERNEL.arg_names}
        attrs = {(KERNEL.arg_names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, *DIVISIBLE)}
        compiled = triton.compile(ASTSource(KERNEL, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        print(method, group, dtype, cfg, "smem", compiled.metadata.shared)
        return compiled


    # what the launcher plans for Llama-3.1-8B's gate/up projection at each batch, every format (int8_grouped in
    # GGUF Q6_K's groups of 16 and Q8_0's of 32)
    for method, group, ms in (("int8", 128, (1, 2, 16, 64)), ("int8_grouped", 16, (1, 4, 16, 64)),
                              ("int8_grouped", 32, (1, 16))):
        for m in ms:
            cfg = qm.plan_quant_matmul(m, 28672, 4096, method, group)
            compiled = compile_quant(method, cfg, group=group)
            if m == 1:
                info = ptxas_info(compiled)
                print(method, group, "batch-1 GEMV:", info)
                assert "0 bytes spill stores" in info, info
                assert "ld.global.v4.b32" in compiled.asm["ptx"], "packed weights not loaded 128 bits at a time"
    # the other loop of each batch, a bias, a K tail, fp16 and fp32 inputs
    compile_quant("int8", qm.plan_quant_matmul(16, 4096, 4096, "int8", use_dot=False), bias=True)
    compile_quant("int8", qm.plan_quant_matmul(2, 4096, 4096, "int8", use_dot=True), even_k=False)
    compile_quant("int8", qm.plan_quant_matmul(1, 4096, 4096, "int8"), dtype="fp16")
    compile_quant("int8", qm.plan_quant_matmul(16, 4096, 4096, "int8"), dtype="fp32")
    compile_quant("int8_grouped", qm.plan_quant_matmul(1, 4096, 4096, "int8_grouped", 16), group=16, bias=True,
                  even_k=False)
    compile_quant("int8_grouped", qm.plan_quant_matmul(16, 4096, 4096, "int8_grouped", 16, use_dot=True), group=16,
                  dtype="fp16", even_k=False)
    compile_quant("int8_grouped", qm.plan_quant_matmul(32, 4096, 4096, "int8_grouped", 32, use_dot=True), group=32,
                  dtype="fp32")

    def compile_gemv(n, k, group=128, dtype="bf16", bias=False, m=1):
        kernel = qg._int4_gemv_kernel
        cfg = qg.plan_int4_gemv(n, k, group)
        pointers = {"x_ptr": dtype, "w_ptr": "i32", "s_ptr": dtype, "z_ptr": zero_dtype(dtype),
                    "bias_ptr": dtype, "part_ptr": "fp32", "counter_ptr": "i32", "out_ptr": dtype}
        constexprs = dict(GROUP=group, BLOCK_M=m, BLOCK_N=cfg.block_n, ROWS=cfg.rows, SPLIT_K=cfg.split > 1, REDUCE_CHUNK=16,
                          EVEN_N=n % cfg.block_n == 0, HAS_BIAS=bias, ASM=True, USE_PDL=True)
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers else "i32"
                     for name in kernel.arg_names}
        attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
                 for name in (*pointers, "N", "stride_xm", "stride_om")}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options={"num_warps": cfg.num_warps})
        info = ptxas_info(compiled)
        print("int4_gemv", m, n, k, group, dtype, cfg, info)
        assert "0 bytes spill stores" in info, info
        assert "ld.global.v4.b32" in compiled.asm["ptx"], "packed weights not loaded 128 bits at a time"
        assert "lop3.b32" in compiled.asm["ptx"]

    # Llama-3.1-8B's four projections, a head of odd width with a bias (masked outputs), group 32, fp16 and fp32
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        compile_gemv(n, k)
    compile_gemv(1000, 896, 32, bias=True)
    compile_gemv(4096, 4096, dtype="fp16")
    compile_gemv(576, 1536, 64, dtype="fp32")
    compile_gemv(28672, 4096, m=2)  # one accumulator per row
    compile_gemv(1000, 896, 32, bias=True, m=2)

    def compile_words(m, n, k, group=128, dtype="bf16", bias=False):
        kernel = qw._int4_words_dot_kernel
        cfg = qw.plan_int4_words_matmul(m, n, k, group)
        pointers = {"x_ptr": dtype, "w_ptr": "i32", "s_ptr": dtype, "z_ptr": zero_dtype(dtype),
                    "bias_ptr": dtype, "part_ptr": "fp32", "counter_ptr": "i32", "out_ptr": dtype}
        magic, offset = {"bf16": (0x4300, 128.0), "fp16": (0x6400, 1024.0)}.get(dtype, (0, 0.0))
        constexprs = dict(GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=cfg.split > 1,
                          SLABS=cfg.slabs, SWAP_AB=cfg.swap_ab, EVEN_N=n % cfg.block_n == 0, HAS_BIAS=bias,
                          UPCAST=dtype == "fp32", MAGIC16=magic, OFFSET16=offset)
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers else "i32"
                     for name in kernel.arg_names}
        attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
                 for name in (*pointers, "N", "stride_xm", "stride_om")}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        info = ptxas_info(compiled)
        print("int4_words_matmul", m, n, k, group, dtype, cfg, info)
        assert "0 bytes spill stores" in info, info
        if dtype != "fp32":
            assert "wgmma.mma_async" in compiled.asm["ptx"], "not on Hopper's tensor cores"

    # tensor cores over the same words: the rows of a batched decode step
    for m in (2, 16, 64):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
            compile_words(m, n, k)
    compile_words(8, 1000, 896, 32, bias=True)
    compile_words(16, 4096, 4096, dtype="fp16")
    compile_words(16, 576, 1536, 64, dtype="fp32")
    # prefill's dequantize kernel: each format it reads into bf16, fp16 and fp32
    for method, group, out in (("int8", 128, "fp32"), ("int8_grouped", 16, "bf16"), ("int8_grouped", 32, "fp16")):
        kernel = qm._dequantize_kernel
        pointers = {"q_ptr": "i8", "s_ptr": out, "out_ptr": out}
        constexprs = dict(GROUP=group, GROUP_SCALES=method != "int8", BLOCK_N=qm.DEQUANT_BLOCK[0],
                          BLOCK_K=qm.DEQUANT_BLOCK[1])
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers else "i32"
                     for name in kernel.arg_names}
        attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
                 for name in (*pointers, "N", "K", "stride_qn", "stride_sg", "stride_on")}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options={"num_warps": 4, "enable_fp_fusion": False})
        info = ptxas_info(compiled)
        print("dequantize", method, group, out, info)
        assert "0 bytes spill stores" in info, info
    # the same from the GEMV's K-major words, one group per program
    for group, out in ((128, "bf16"), (32, "fp32")):
        kernel = qw._dequantize_k_major_kernel
        pointers = {"w_ptr": "i32", "s_ptr": out, "z_ptr": zero_dtype(out), "out_ptr": out}
        constexprs = dict(GROUP=group, BLOCK_N=qw.DEQUANT_K_MAJOR_BLOCK_N)
        signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name in pointers else "i32"
                     for name in kernel.arg_names}
        attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, "N")}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                                  options={"num_warps": 4, "enable_fp_fusion": False})
        info = ptxas_info(compiled)
        print("dequantize_k_major", group, out, info)
        assert "0 bytes spill stores" in info, info
    print("quant kernels compiled for sm_90")
    """
)


def test_quant_matmul_kernels_compile_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "quant kernels compiled for sm_90" in result.stdout
