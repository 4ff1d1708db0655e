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
    import os
    import re
    import subprocess
    import sys
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from questkv.ops.triton import append, decode_attention, elementwise, estimate, gemv, prefill_attention, reuse, select

    TARGET = GPUTarget("cuda", 90, 32)


    def compile_kernel(kernel, pointers, constexprs, floats=(), num_warps=4, maxnreg=None, divisible=(), num_stages=3):
        # divisible: integer arguments known to be multiples of 16 (with every pointer, as a launch with
        # such values specializes them), so that loads vectorize as they do at run time
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name in pointers:
                signature[name] = "*" + pointers[name]
            else:
                signature[name] = "fp32" if name in floats else "i32"
        attrs = {}
        if divisible:
            attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in (*pointers, *divisible)}
        src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": num_warps, "num_stages": num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg})}
        compiled = triton.compile(src, target=TARGET, options=options)
        print(kernel.__name__, sorted(constexprs.items()), "smem", compiled.metadata.shared)
        return compiled


    def ptxas_info(compiled):
        # ptxas -v's register and spill lines for a compiled kernel (Triton's bundled ptxas)
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "kernel.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            result = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", ptx, "-o",
                                     os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
        lines = [line for line in result.stderr.splitlines() if "spill" in line or "Used" in line]
        return " ".join(line.split("info    : ")[-1] for line in lines)


    def compile_attention(dtype, dense, group, sel_per_kv, pdl=False, merge_chunk=decode_attention._MERGE_CHUNK,
                          kind=None, pool=None, num_queries=1, row_budgets=False):
        ieee = dtype == "fp32"
        pool = pool or dtype
        block = decode_attention.query_block(num_queries, group)
        e4m3 = pool == "fp8e4nv" and dtype in ("bf16", "fp16") and num_queries == 1  # (the launcher's _e4m3_dot)
        rows = max(16, triton.next_power_of_2((2 if e4m3 else block) * group))
        kind = kind or decode_attention.grid_kind(dense, 64, pool == "fp8e4nv",
                                                  decode_attention._verify_rows(num_queries, block, group))
        return compile_kernel(
            decode_attention._decode_split_kernel,
            {"q_ptr": dtype, "k_pages_ptr": pool, "v_pages_ptr": pool, "table_ptr": "i32",
             "lens_ptr": "i32", "sel_ptr": "i32", "budgets_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
             "counter_ptr": "i32", "out_ptr": dtype},
            {"PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "GROUP": group, "BLOCK_G": rows,
             "BLOCK_GM": triton.next_power_of_2(group), "SEL_PER_KV": sel_per_kv,
             "NUM_QUERIES": num_queries, "QUERY_BLOCK": block,
             "PAGES_PER_ITER": decode_attention.pages_per_iter(16, kind), "MERGE_CHUNK": merge_chunk,
             "DENSE": dense, "UPCAST": False, "IEEE": ieee, "USE_PDL": pdl,
             "F16_DOT": pool == "fp8e4nv" and dtype == "bf16", "ROW_BUDGETS": row_budgets, "E4M3_DOT": e4m3},
            floats=("qk_scale",),
            num_warps=decode_attention._WARPS_BY_ROWS.get(rows, 2 * decode_attention._NUM_WARPS),
            num_stages=decode_attention._CONFIG[kind][2],
            # strides of B=1 with 32 / 8 heads, 129 selected pages (selection reuse), 17 splits
            divisible=("stride_qb", "stride_qq", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt",
                       "stride_vh", "stride_tb", "stride_pb", "stride_ph", "stride_ps", "stride_ob", "stride_oq", "stride_oh"),
        )


    # the K/V append alone (fp32 tokens into a bf16 pool) and with RoPE folded in (bf16, a group of 4 query heads,
    # programmatic dependent launch as on an H200), and into an fp8 pool (its bytes: the kernel rounds to e4m3)
    for rotate, token_dtype, pool in ((False, "fp32", "bf16"), (True, "bf16", "bf16"), (True, "bf16", "u8")):
        compiled = compile_kernel(
            append._append_kv_kernel,
            {"k_pages_ptr": pool, "v_pages_ptr": pool, "kmin_ptr": pool, "kmax_ptr": pool,
             "slots_ptr": "i64", "keys_ptr": token_dtype, "values_ptr": token_dtype, "q_ptr": token_dtype,
             "cos_ptr": token_dtype, "sin_ptr": token_dtype},
            {"PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "FIRST": 64 if rotate else 128,
             "BLOCK_H": 64 if rotate else 128, "GROUP": 4 if rotate else 1, "BLOCK_G": 4 if rotate else 1,
             "ROTATE": rotate, "FP8": pool == "u8", "CAST_FP8": True, "USE_PDL": rotate},
            num_warps=1,
        )
        # fp8: rounded by the hardware's conversion, not _e4m3_byte's arithmetic
        assert ("cvt.rn.satfinite.e4m3x2.f32" in compiled.asm["ptx"]) == (pool == "u8")
    def compile_estimate(q_dtype, mode, group, blocks, pdl, active=False, bounds="bf16"):
        compile_kernel(
            estimate._page_scores_kernel,
            {"q_ptr": q_dtype, "kmin_ptr": bounds, "kmax_ptr": bounds, "table_ptr": "i32",
             "lens_ptr": "i32", "active_ptr": "i32", "out_ptr": "fp32"},
            {"PAGE_SIZE": 16, "GROUP": group, "BLOCK_G": 16, "HEAD_DIM": 128, "BLOCK_P": estimate._BLOCK_P,
             "BLOCK_D": 128, "MODE": mode, "DOT_FP32": q_dtype == "fp32", "BLOCKS": blocks, "NUM_STAGES": 2,
             "HAS_ACTIVE": active, "USE_PDL": pdl},
        )


    for mode, group, pdl in ((0, 4, False), (1, 4, False), (2, 4, False), (1, 1, False), (1, 4, True)):
        compile_estimate("bf16", mode, group, 2, pdl)
    # per-sequence active flags (selection reuse): programs of inactive sequences return early
    compile_estimate("bf16", 1, 4, 2, True, active=True)
    compile_estimate("bf16", 1, 4, 2, True, bounds="fp8e4nv")  # an fp8 pool's bounds, cast to bf16 in registers
    compile_estimate("bf16", 0, 4, 1, False, active=True)
    for dense, group, sel_per_kv in ((False, 4, 1), (True, 4, 1), (False, 1, 1), (False, 1, 4)):
        compile_attention("bf16", dense, group, sel_per_kv)
    compile_attention("bf16", False, 4, 1, pdl=True)
    compile_attention("bf16", False, 4, 1, pdl=True, row_budgets=True)  # requests below the step's budget
    compile_attention("bf16", True, 4, 1, pdl=True)
    compile_attention("fp16", False, 4, 1)
    # an fp8 (e4m3) KV cache under 16-bit queries: scores in e4m3 tensor-core dots (wgmma, the keys straight from
    # shared memory), the values staged in shared memory as pairs and converted to float16, never read back a byte
    # per instruction (the plain float8 load's ld.shared.b8, 64 per thread per tile; a sparse tile's 4 are its
    # keys' mask, loaded with the selection, moving to the scores' layout)
    for dense, dtype in ((False, "bf16"), (True, "bf16"), (True, "fp16")):
        kind = decode_attention.grid_kind(dense, 64, True)
        compiled = compile_attention(dtype, dense, 4, 1, pdl=True, pool="fp8e4nv", kind=kind)
        ptx = compiled.asm["ptx"]
        assert re.search(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n16k32\\.f32\\.e4m3\\.e4m3", ptx)
        assert "cvt.rn.f16x2.e4m3x2" in ptx
        assert len(re.findall(r"ld\\.shared(\\.v[248])?\\.[bsu]8", ptx)) <= (0 if dense else 4)
        assert "0 bytes spill stores" in ptxas_info(compiled)
        # the programs per SM its split plan aims at fit in an SM's 228 KiB (1 KiB reserved per block)
        assert decode_attention._CONFIG[kind][1] * (compiled.metadata.shared + 1024) <= 228 * 1024
    # the wide merge (few programs, groups of at most 4) must not spill, nor batch 1's dense grid (128 keys per
    # iteration, its first tile prefetched into L2 before the programmatic-launch wait); the divisibility of a
    # run's launch
    for dense, kind in ((False, None), (True, None), (True, "dense-few")):
        compiled = compile_attention("bf16", dense, 4, 1, pdl=True, merge_chunk=decode_attention._WIDE_MERGE_CHUNK, kind=kind)
        info = ptxas_info(compiled)
        print("attention, wide merge:", kind, info)
        assert "0 bytes spill stores" in info, info
        print("prefetches", compiled.asm["ptx"].count("prefetch.global.L2"))
        assert (compiled.asm["ptx"].count("prefetch.global.L2") > 0) == dense
    compile_attention("fp32", False, 4, 1)
    compile_attention("fp32", True, 4, 1)
    # a lossless verify step's attention (several queries per sequence, causal among them) in the launch it takes
    # (grid_kind): GQA groups of 4 (the 8B) and 6 (Qwen2.5-1.5B) and MHA (llama2-7b) from 2 to 17 positions, an fp8
    # pool, a query tile of 16 to 64 rows; none may spill
    for group, num_queries, pool in ((4, 2, None), (4, 5, None), (4, 9, None), (4, 17, None), (6, 9, None),
                                     (1, 17, None), (4, 5, "fp8e4nv"), (1, 5, None)):
        compiled = compile_attention("bf16", True, group, 1, pdl=True, pool=pool, num_queries=num_queries)
        info = ptxas_info(compiled)
        print("attention, verify:", group, num_queries, pool, info)
        assert "0 bytes spill stores" in info, info
    compile_estimate("fp32", 1, 4, 1, False)
    # selection reuse: the memory's gather and store (llama2-7b's 30 sparse layers of 32 heads and 129 columns;
    # PDL on and off)
    for pdl in (True, False):
        compile_kernel(
            reuse._gather_selections_kernel,
            {"pages_ptr": "i32", "selected_at_ptr": "i32", "slots_ptr": "i64", "due_ptr": "i64", "lens_ptr": "i32",
             "active_ptr": "i32", "selected_ptr": "i32", "row_at_ptr": "i32", "num_pages_ptr": "i32"},
            {"LAYERS": 30, "HEADS": 32, "WIDTH": 129, "BUDGET": 128, "PAGE_SIZE": 16, "BLOCK_H": 32, "BLOCK_W": 256,
             "USE_PDL": pdl},
            num_warps=reuse._NUM_WARPS,
        )
        compile_kernel(
            reuse._store_selections_kernel,
            {"pages_ptr": "i32", "selected_at_ptr": "i32", "selections_ptr": "i64", "steps_ptr": "i64",
             "last_ptr": "i64", "slots_ptr": "i64", "selected_ptr": "i32", "row_at_ptr": "i32", "active_ptr": "i32"},
            {"LAYERS": 30, "HEADS": 32, "WIDTH": 129, "BLOCK_H": 32, "BLOCK_W": 256, "USE_PDL": pdl},
            num_warps=reuse._NUM_WARPS,
        )
    # the one-program select: chunks and warps as the launcher picks them (select.row_launch) for tables of
    # 64 and 2048 pages (one chunk, no loop), of the default chunk and wider, and chunks of 512 / 2048; budgets
    # up to a dense row's 4096 pages; no spills at the default chunk nor in the one-chunk kernel at 2048 pages
    default_row_block = select._ROW_BLOCK
    for max_pages, row_block, budget, has_budgets, active in (
            (4096, None, 128, True, False), (8192, None, 4096, False, False), (64, None, 64, True, False),
            (2048, None, 128, True, True), (4096, 512, 256, True, False), (4096, 2048, 128, False, False),
            (4096, None, 128, True, True)):
        select._ROW_BLOCK = row_block or default_row_block
        launch = select.row_launch(max_pages)
        compiled = compile_kernel(
            select._select_pages_kernel,
            {"scores_ptr": "fp32", "lens_ptr": "i32", "budgets_ptr": "i32", "active_ptr": "i32", "out_ptr": "i32"},
            {"PAGE_SIZE": 16, "BUDGET": budget, "SINK": 1, "RECENT": 2, "BLOCK": launch["BLOCK"],
             "SINGLE": launch["SINGLE"], "HAS_BUDGETS": has_budgets, "HAS_ACTIVE": active},
            num_warps=launch["num_warps"],
        )
        if row_block is None and max_pages in (2048, 4096):
            info = ptxas_info(compiled)
            print(f"select row path, {max_pages} columns (single chunk: {launch['SINGLE']}):", info)
            assert "0 bytes spill stores" in info, info
    split_pointers = {"scores_ptr": "fp32", "lens_ptr": "i32", "budgets_ptr": "i32", "active_ptr": "i32",
                      "hist_ptr": "i32", "chunk_hist_ptr": "i32", "chunk_above_ptr": "i32", "counter_ptr": "i32",
                      "out_ptr": "i32"}
    for digit_bits, chunk, has_budgets, active in ((8, 512, True, False), (11, 1024, False, False), (8, 512, True, True)):
        passes = -(-32 // digit_bits)
        split = {"PAGE_SIZE": 16, "BUDGET": 4096, "SINK": 1, "RECENT": 2, "HAS_BUDGETS": has_budgets, "CHUNK": chunk,
                 "DIGIT_BITS": digit_bits, "BINS": 1 << digit_bits, "LAST_BINS": 1 << (32 - (passes - 1) * digit_bits),
                 "NUM_PASSES": passes, "HAS_ACTIVE": active}
        for p in range(passes):
            compile_kernel(select._split_histogram_kernel, split_pointers, {**split, "PASS": p})
        compile_kernel(select._split_compact_kernel, split_pointers, {**split, "BLOCK_C": 16, "PAD_BLOCK": 256})
    # paged prefill attention: the launcher's tiles (prefill_attention.tile_tokens) and warps for bf16 and fp32
    # (IEEE), groups of 1, 4 (Llama-3.1-8B) and 7, head_dim 128 and 64, pages of 16 and 64, a short query's
    # 16-row tile, an fp32 pool under bf16 queries (cast in the kernel), keys split over programs (few tiles);
    # Llama-3.1-8B's shape must not spill
    def compile_prefill(dtype, group, head_dim, page_size, max_query_len, pool="same", split=False):
        block_g = 1 << (group - 1).bit_length()
        tokens = prefill_attention.tile_tokens(max_query_len, block_g)
        pool = dtype if pool == "same" else pool
        return compile_kernel(
            prefill_attention._prefill_kernel,
            {"q_ptr": dtype, "k_pages_ptr": pool, "v_pages_ptr": pool, "table_ptr": "i32", "starts_ptr": "i32",
             "lens_ptr": "i32", "out_ptr": dtype, "part_out_ptr": "fp32", "part_lse_ptr": "fp32"},
            {"PAGE_SIZE": page_size, "HEAD_DIM": head_dim, "BLOCK_D": head_dim, "GROUP": group, "BLOCK_G": block_g,
             "TILE_TOKENS": tokens, "BLOCK_N": prefill_attention._BLOCK_N, "SPLIT": split, "UPCAST": False,
             "IEEE": dtype == "fp32"},
            floats=("qk_scale",),
            num_warps=prefill_attention._NUM_WARPS[tokens * block_g],
            divisible=("stride_qt", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt",
                       "stride_vh", "stride_ot", "stride_oh", "stride_pt", "stride_ph", "stride_lt"),
        )


    def compile_gemv(n, k, cfg, dtype="bf16", bias=False, even=True, pdl=True):
        return compile_kernel(
            gemv._gemv_kernel,
            {"x_ptr": dtype, "w_ptr": dtype, "bias_ptr": dtype, "part_ptr": "fp32", "counter_ptr": "i32",
             "out_ptr": dtype},
            {"BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SPLIT_K": cfg.split > 1,
             "HAS_BIAS": bias, "EVEN": even, "REDUCE_CHUNK": gemv._REDUCE_CHUNK, "USE_PDL": pdl},
            num_warps=cfg.num_warps,
            divisible=("N", "K", "stride_wn", "k_per_split") if even else ("k_per_split",),
        )


    for config in (("bf16", 4, 128, 16, 512), ("bf16", 4, 128, 16, 3), ("bf16", 1, 128, 16, 512),
                   ("bf16", 7, 64, 16, 512), ("bf16", 4, 128, 64, 48), ("fp32", 4, 128, 16, 512),
                   ("bf16", 4, 128, 16, 512, "fp32"), ("bf16", 4, 128, 16, 48, "same", True),
                   ("bf16", 4, 128, 16, 1, "same", True), ("bf16", 4, 128, 16, 5, "fp8e4nv"),
                   ("bf16", 4, 128, 16, 5, "fp8e4nv", True)):
        compiled = compile_prefill(*config)
        if "fp8e4nv" in config:  # fp8 values staged as pairs, as in the decode attention
            assert re.search(r"ld\\.shared(\\.v[248])?\\.[bsu]8", compiled.asm["ptx"]) is None
        if config == ("bf16", 4, 128, 16, 512):
            info = ptxas_info(compiled)
            print("paged_prefill_attention llama-3.1-8b:", info)
            assert "0 bytes spill stores" in info, info
    # the batch-1 dense GEMV: Llama-3.1-8B's qkv and o projections as the launcher plans them, bf16 with PDL:
    # 128-bit weight loads, no spills; a split, a masked odd shape with a bias, fp16 and fp32
    for n, k in ((6144, 4096), (4096, 4096)):
        cfg = gemv.plan_gemv(n, k)
        compiled = compile_gemv(n, k, cfg)
        info = ptxas_info(compiled)
        print("gemv llama-3.1-8b", n, k, cfg, info)
        assert "0 bytes spill stores" in info, info
        assert "ld.global.v4.b32" in compiled.asm["ptx"], "weights not loaded 128 bits at a time"
    compile_gemv(1000, 900, gemv.plan_gemv(1000, 900), bias=True, even=False, pdl=False)
    compile_gemv(4096, 4096, gemv.GemvConfig(16, 512, 4, 2), dtype="fp16")
    compile_gemv(576, 1536, gemv.plan_gemv(576, 1536), dtype="fp32")
    # RMSNorm (with and without the residual add) and SiLU-and-multiply at Llama-3.1-8B's widths, bf16 under PDL,
    # and float32; no spills
    for dtype, pdl in (("bf16", True), ("fp32", False)):
        for residual in (False, True):
            compiled = compile_kernel(
                elementwise._rms_norm_kernel,
                {"x_ptr": dtype, "residual_ptr": dtype, "weight_ptr": dtype, "out_ptr": dtype, "sum_ptr": dtype},
                {"BLOCK": 4096, "HAS_RESIDUAL": residual, "USE_PDL": pdl}, floats=("eps",),
                divisible=("stride_x", "stride_r", "stride_o", "stride_s"))
            assert "0 bytes spill stores" in ptxas_info(compiled)
        compiled = compile_kernel(elementwise._silu_and_mul_kernel, {"x_ptr": dtype, "out_ptr": dtype},
                                  {"BLOCK": elementwise._SILU_BLOCK, "USE_PDL": pdl}, divisible=("I", "stride_x", "stride_o"))
        assert "0 bytes spill stores" in ptxas_info(compiled)
    print("all kernels compiled for sm_90")
    """
)


def test_every_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all kernels compiled for sm_90" in result.stdout
