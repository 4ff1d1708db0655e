"""Compile every Quest Triton kernel for sm_90 (H100/H200) without a GPU.

The interpreter misses compile-only errors (layouts, dtypes of ``tl.dot``, constexpr misuse);
``triton.compile`` with a CUDA target catches them. It needs kernels built by ``triton.jit``
without ``TRITON_INTERPRET``, so the compilation runs in a subprocess.
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
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from questkv.ops.triton import append, attention, codes, estimate, select

    TARGET = GPUTarget("cuda", 90, 32)


    def compile_kernel(kernel, pointers, constexprs, floats=(), num_warps=4):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = "*" + pointers[name]
            else:
                signature[name] = "fp32" if name in floats else "i32"
        src = ASTSource(kernel, signature, constexprs=constexprs)
        compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
        print(kernel.__name__, sorted(constexprs.items()), "smem", compiled.metadata.shared)


    def compile_attention(dtype, dense, group, sel_per_kv, pdl=False):
        ieee = dtype == "fp32"
        compile_kernel(
            attention._decode_split_kernel,
            {"q_ptr": dtype, "k_pages_ptr": dtype, "v_pages_ptr": dtype, "table_ptr": "i32",
             "lens_ptr": "i32", "sel_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
             "counter_ptr": "i32", "out_ptr": dtype},
            {"PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "GROUP": group, "BLOCK_G": 16,
             "BLOCK_GM": group, "SEL_PER_KV": sel_per_kv,
             "PAGES_PER_ITER": attention.pages_per_iter(16, dense), "MERGE_CHUNK": attention._MERGE_CHUNK,
             "DENSE": dense, "UPCAST": False, "IEEE": ieee, "USE_PDL": pdl},
            floats=("qk_scale",),
            num_warps=attention._NUM_WARPS,
        )


    compile_kernel(
        append._append_kv_kernel,
        {"k_pages_ptr": "bf16", "v_pages_ptr": "bf16", "kmin_ptr": "bf16", "kmax_ptr": "bf16",
         "slots_ptr": "i64", "keys_ptr": "fp32", "values_ptr": "fp32"},
        {"PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128},
        num_warps=1,
    )
    def compile_estimate(q_dtype, mode, group, blocks, pdl):
        compile_kernel(
            estimate._page_scores_kernel,
            {"q_ptr": q_dtype, "kmin_ptr": "bf16", "kmax_ptr": "bf16", "table_ptr": "i32",
             "lens_ptr": "i32", "out_ptr": "fp32"},
            {"PAGE_SIZE": 16, "GROUP": group, "BLOCK_G": 16, "HEAD_DIM": 128, "BLOCK_P": estimate._BLOCK_P,
             "BLOCK_D": 128, "MODE": mode, "DOT_FP32": q_dtype == "fp32", "BLOCKS": blocks, "NUM_STAGES": 2,
             "USE_PDL": pdl},
        )


    for mode, group, pdl in ((0, 4, False), (1, 4, False), (2, 4, False), (1, 1, False), (1, 4, True)):
        compile_estimate("bf16", mode, group, 2, pdl)
    for dense, group, sel_per_kv in ((False, 4, 1), (True, 4, 1), (False, 1, 1), (False, 1, 4)):
        compile_attention("bf16", dense, group, sel_per_kv)
    compile_attention("bf16", False, 4, 1, pdl=True)
    compile_attention("bf16", True, 4, 1, pdl=True)
    compile_attention("fp16", False, 4, 1)
    compile_attention("fp32", False, 4, 1)
    compile_attention("fp32", True, 4, 1)
    compile_estimate("fp32", 1, 4, 1, False)
    for block_n, block_k, has_budgets in ((2048, 128, True), (8192, 256, False), (64, 64, True)):
        compile_kernel(
            select._select_pages_kernel,
            {"scores_ptr": "fp32", "lens_ptr": "i32", "budgets_ptr": "i32", "out_ptr": "i32"},
            {"PAGE_SIZE": 16, "BUDGET": block_k, "SINK": 1, "RECENT": 2, "BLOCK_N": block_n, "BLOCK_K": block_k,
             "HAS_BUDGETS": has_budgets},
            num_warps=8,
        )
    split_pointers = {"scores_ptr": "fp32", "lens_ptr": "i32", "budgets_ptr": "i32", "hist_ptr": "i32",
                      "chunk_hist_ptr": "i32", "chunk_above_ptr": "i32", "counter_ptr": "i32", "out_ptr": "i32"}
    for digit_bits, chunk, has_budgets in ((8, 512, True), (11, 1024, False)):
        passes = -(-32 // digit_bits)
        split = {"PAGE_SIZE": 16, "BUDGET": 4096, "SINK": 1, "RECENT": 2, "HAS_BUDGETS": has_budgets, "CHUNK": chunk,
                 "DIGIT_BITS": digit_bits, "BINS": 1 << digit_bits, "LAST_BINS": 1 << (32 - (passes - 1) * digit_bits),
                 "NUM_PASSES": passes}
        for p in range(passes):
            compile_kernel(select._split_histogram_kernel, split_pointers, {**split, "PASS": p})
        compile_kernel(select._split_compact_kernel, split_pointers, {**split, "BLOCK_C": 16, "PAD_BLOCK": 256})
    # low-bit key codes (opt-in): the encoder at every width, the scores kernel for every mode and
    # width, bf16 queries (two 16-bit dots) and fp32 (IEEE), pages of 16 and 8 tokens
    for bits in (1, 2, 4, 8):
        nbytes = 128 * bits // 8
        compile_kernel(
            codes._encode_page_keys_kernel,
            {"codes_ptr": "u8", "k_pages_ptr": "bf16", "kmin_ptr": "bf16", "kmax_ptr": "bf16", "pages_ptr": "i32"},
            {"PAGE_SIZE": 16, "BLOCK_T": 16, "NBYTES": nbytes, "BLOCK_B": nbytes, "BITS": bits},
            num_warps=1 if 16 * nbytes <= 1024 else 4,
        )
    for q_dtype, mode, group, bits, page_size in (("bf16", 1, 4, 2, 16), ("bf16", 2, 4, 1, 16), ("bf16", 0, 4, 4, 16),
                                                  ("bf16", 1, 4, 8, 16), ("bf16", 1, 1, 2, 16), ("bf16", 1, 8, 2, 8),
                                                  ("fp32", 1, 4, 2, 16)):
        compile_kernel(
            codes._page_scores_codes_kernel,
            {"q_ptr": q_dtype, "codes_ptr": "u8", "kmin_ptr": "bf16", "kmax_ptr": "bf16", "table_ptr": "i32",
             "lens_ptr": "i32", "out_ptr": "fp32"},
            {"PAGE_SIZE": page_size, "PS_PAD": page_size, "GROUP": group, "BLOCK_G": 16, "HEAD_DIM": 128,
             "BLOCK_D": 128, "BLOCK_P": max(codes._BLOCK_P, 16 // page_size), "BITS": bits, "MODE": mode,
             "DOT_FP32": q_dtype == "fp32"},
            num_warps=codes.scores_num_warps(q_dtype == "fp32"),
        )
    print("all kernels compiled for sm_90")
    """
)


def test_every_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all kernels compiled for sm_90" in result.stdout
