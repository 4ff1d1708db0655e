"""Weight-only quantized matmul: the storage format against an independent unpack, round-to-nearest quantization,
the torch reference, the dispatch of :mod:`questkv.ops`, and the Triton kernels (under ``TRITON_INTERPRET=1``)
against the reference: ``int8`` / ``int8_grouped`` over the checkpoint layout, ``int4`` over K-major words.

Tolerances: float32 inputs 1e-5 relative to the largest output (float32 sums in another order; the one-row
GEMV 1e-4: its high nibbles carry their pair's low nibble in the float's last mantissa bits, up to 15 / 65536 of
``x`` per product); float16 inputs 2e-3 (one float16 rounding of the output, the 1024-offset trick of the
``tl.dot`` loop); bfloat16 inputs one bfloat16 step of the largest output (the interpreter truncates float32 to
bfloat16 instead of rounding).
"""

import dataclasses
import zlib

import numpy as np
import pytest
import torch

from questkv import ops
from questkv.ops import quant_reference as ref

qk = pytest.importorskip("questkv.ops.triton.quant_matmul")
from questkv.ops.triton import int4_gemv as qg  # noqa: E402
from questkv.ops.triton import int4_words as qwords  # noqa: E402
from questkv.ops.triton import quant_ops  # noqa: E402
from questkv.ops.triton._common import ticket_counters  # noqa: E402
from questkv.ops.triton.quant_tiles import PROGRAMS_PER_SM  # noqa: E402

N_ODD, K = 37, 384  # odd outputs; K = 3 groups of 128 (not a multiple of the FMA loop's 256: a tail iteration)


def _weight(method, n, k, seed, dtype=torch.float32, group_size=128):
    gen = torch.Generator().manual_seed(seed)
    if method == "int8_grouped":  # a checkpoint format (nothing rounds to it): random codes, the full int8 range
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = (0.5 + torch.rand((k // group_size, n), generator=gen)) / 127
        return ref.QuantizedWeight(codes, scales.to(dtype), None)
    w = torch.randn((n, k), generator=gen) * (0.5 + torch.rand((n, 1), generator=gen))
    return ref.quantize_weight(w, method, group_size, dtype=dtype)


def _inputs(m, k, n, seed, dtype):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn((m, k), generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# the format
# ---------------------------------------------------------------------------------------------------------------


def test_unpack_matches_an_independent_byte_and_word_reading():
    gen = torch.Generator().manual_seed(3)
    qweight = torch.randint(0, 256, (5, 64), generator=gen, dtype=torch.uint8)
    got = ref.unpack_int4(qweight).numpy()
    raw = qweight.numpy()
    for n in range(raw.shape[0]):
        for j, byte in enumerate(raw[n].tolist()):
            assert got[n, 2 * j] == byte % 16 and got[n, 2 * j + 1] == byte // 16
        # the kernels' view: little-endian int32 words, value 8j + i in bits 4i .. 4i + 3
        words = np.frombuffer(raw[n].tobytes(), dtype="<u4")
        for j, word in enumerate(words.tolist()):
            assert [(word >> (4 * i)) & 15 for i in range(8)] == got[n, 8 * j : 8 * j + 8].tolist()
    assert torch.equal(ref.pack_int4(ref.unpack_int4(qweight)), qweight)


@pytest.mark.parametrize("group_size", ref.GROUP_SIZES)
def test_the_k_major_layout_puts_each_code_where_its_docstring_says(group_size):
    gen = torch.Generator().manual_seed(group_size)
    n, k = 6, 2 * group_size
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    words = ref.pack_int4_k_major(ref.pack_int4(q), group_size)
    assert words.dtype == torch.int32 and words.shape == (k // 8, n)
    per = group_size // 8
    raw = words.numpy().view("<u4")
    for row in range(k // 8):
        g, j = divmod(row, per)
        for col in range(n):
            nibbles = [(int(raw[row, col]) >> (4 * e)) & 15 for e in range(8)]
            assert nibbles == [int(q[col, g * group_size + e * per + j]) for e in range(8)]
    assert torch.equal(ref.unpack_int4_k_major(words, group_size), ref.pack_int4(q))


@pytest.mark.parametrize("method", ref.METHODS)
def test_round_to_nearest_stays_within_half_a_step_and_zero_groups_stay_zero(method):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn((6, 256), generator=gen)
    w[2, :128] = 0.0  # a whole int4 group of zeros
    w[4] = 0.0  # a whole int8 row of zeros
    qw = ref.quantize_weight(w, method)
    back = ref.dequantize(*qw, method)
    if method == "int4":
        assert qw.qweight.dtype == torch.uint8 and qw.qweight.shape == (6, 128) and qw.scales.shape == (2, 6)
        step = qw.scales.t().repeat_interleave(128, dim=1)  # [N, K]
        assert torch.all((qw.zeros == qw.zeros.round()) & (qw.zeros >= 0) & (qw.zeros <= 15))
    else:
        assert qw.qweight.dtype == torch.int8 and qw.zeros is None and qw.scales.shape == (6,)
        step = qw.scales[:, None].expand_as(w)
    assert torch.all((back - w).abs() <= step / 2 + 1e-6)
    assert torch.all(back[2, :128] == 0) and torch.all(back[4] == 0)


@pytest.mark.parametrize("method", ref.METHODS)
def test_reference_is_the_float_matmul_of_the_dequantized_weight(method):
    qw = _weight(method, N_ODD, K, seed=7)
    x, bias = _inputs(3, K, N_ODD, seed=7, dtype=torch.float32)
    want = x @ ref.dequantize(*qw, method).t() + bias
    torch.testing.assert_close(ref.quant_matmul(x, *qw, method, bias=bias), want, rtol=1e-5, atol=1e-5)
    if method == "int4":  # the same weight held as K-major words
        words = ref.pack_int4_k_major(qw.qweight, 128)
        torch.testing.assert_close(ref.int4_matmul(x, words, qw.scales, qw.zeros, bias=bias), want, rtol=1e-5,
                                   atol=1e-5)


def test_bad_arguments_raise_value_errors_naming_them():
    qw = _weight("int4", 8, 256, seed=1)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="quantization must be one of 'int4', 'int8', 'int8_grouped'; got 'int3'"):
        ref.quant_matmul(x, *qw, "int3")
    with pytest.raises(ValueError, match="in_features must be a multiple of the int4 group size 128, got 200"):
        ref.quantize_weight(torch.randn(4, 200), "int4")
    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128, 256; got 100"):
        ref.quantize_weight(torch.randn(4, 200), "int4", group_size=100)
    with pytest.raises(ValueError, match="scales must have shape"):
        ref.quant_matmul(x, qw.qweight, qw.scales.t(), qw.zeros, "int4")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.quant_matmul(x, *qw, "int4", backend="cutlass")
    with pytest.raises(ValueError, match=r"int4_matmul: words must be int32 \[K // 8, N\]"):
        ops.int4_matmul(x, qw.qweight, qw.scales, qw.zeros)


def test_dispatch_picks_the_reference_on_cpu_and_the_kernels_by_rows_agree():
    """``auto`` on the CPU is the reference; ``triton`` (the interpreter) takes the kernel up to
    :data:`~questkv.ops.triton.quant_ops.TRITON_MAX_M` rows and the float weight above, each within the kernel
    tolerance of the reference."""
    qw = _weight("int4", N_ODD, K, seed=11)
    x, bias = _inputs(4, K, N_ODD, seed=11, dtype=torch.float32)
    want = ref.quant_matmul(x, *qw, "int4", bias=bias)
    assert torch.equal(ops.quant_matmul(x, *qw, "int4", bias=bias), want)
    words = ref.pack_int4_k_major(qw.qweight, 128)
    assert torch.equal(ops.int4_matmul(x, words, qw.scales, qw.zeros, bias=bias),
                       ref.int4_matmul(x, words, qw.scales, qw.zeros, bias=bias))
    q8 = _weight("int8", N_ODD, K, seed=12)
    for m in (3, quant_ops.TRITON_MAX_M + 1):
        x, _ = _inputs(m, K, N_ODD, seed=m, dtype=torch.float32)
        torch.testing.assert_close(ops.quant_matmul(x, *q8, "int8", bias=bias, backend="triton"),
                                   ref.quant_matmul(x, *q8, "int8", bias=bias), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the Triton kernel (interpreter)
# ---------------------------------------------------------------------------------------------------------------

_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2 ** -7}


def _check_kernel(method, m, dtype, use_dot, seed, n=N_ODD, k=K, group_size=128, bias=True, swap_ab=None):
    qw = _weight(method, n, k, seed, dtype, group_size)
    x, b = _inputs(m, k, n, seed, dtype)
    b = b if bias else None
    cfg = qk.plan_quant_matmul(m, n, k, method, group_size, torch.device("cpu"), use_dot=use_dot)
    if swap_ab is not None:
        cfg = dataclasses.replace(cfg, swap_ab=swap_ab)
    zeros = None if qw.zeros is None else _held_zeros(qw.zeros, dtype)
    got = qk.quant_matmul(x, qw.qweight, qw.scales, zeros, method, group_size, bias=b, config=cfg)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    want = ref.quant_matmul(x.float(), qw.qweight, qw.scales.float(), f32(qw.zeros), method, group_size, f32(b))
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.float() - want).abs().max().item() / want.abs().max().item()
    assert err <= _TOL[dtype], (method, m, dtype, use_dot, cfg, err)
    return cfg


@pytest.mark.parametrize("method", ["int8"])  # int8_grouped: below
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, use_dot", [(1, False), (3, False), (16, False), (1, True), (16, True), (33, True)])
def test_kernel_matches_the_reference(method, dtype, m, use_dot):
    seed = zlib.crc32(f"{method} {dtype} {m} {use_dot}".encode()) % 1000  # fresh per test, reproducible
    cfg = _check_kernel(method, m, dtype, use_dot, seed)
    assert cfg.split_k > 1  # a small N gets several programs per output tile: the ticket path is exercised


@pytest.mark.parametrize("method, group_size, m, use_dot, swap_ab", [
    ("int8", 128, 2, False, None), ("int8", 128, 5, True, True), ("int8", 128, 1, False, None),
    ("int8", 128, 16, True, False), ("int8_grouped", 16, 2, False, None), ("int8_grouped", 32, 17, True, True)])
def test_kernel_matches_the_reference_in_bfloat16(method, group_size, m, use_dot, swap_ab):
    _check_kernel(method, m, torch.bfloat16, use_dot, seed=m + 17, group_size=group_size, swap_ab=swap_ab)


@pytest.mark.parametrize("group_size", [16, 32])  # GGUF Q6_K, Q8_0
@pytest.mark.parametrize("m", [1, 3, 17])  # the FMA loop at 1 row, the tl.dot loop at 3 and 17
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_the_reference_for_grouped_int8(group_size, m, bias):
    seed = zlib.crc32(f"int8_grouped {group_size} {m} {bias}".encode()) % 1000
    cfg = _check_kernel("int8_grouped", m, torch.float32, None, seed, group_size=group_size, bias=bias)
    assert cfg.use_dot == (m > qk.FMA_MAX_M["int8_grouped"]) and cfg.split_k > 1


def test_kernel_rejects_a_bad_grouped_int8_weight():
    qw = _weight("int8_grouped", 8, 64, seed=3, group_size=16)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size must be one of 16, 32, 64, 128, 256; got 8"):
        qk.quant_matmul(x, qw.qweight, qw.scales, None, "int8_grouped", 8)
    with pytest.raises(ValueError, match="in_features must be a multiple of the int8_grouped group size 32, got 48"):
        qk.quant_matmul(torch.randn(2, 48), qw.qweight[:, :48], qw.scales[:1], None, "int8_grouped", 32)
    with pytest.raises(ValueError, match=r"scales must have shape \(4, 8\)"):
        qk.quant_matmul(x, qw.qweight, qw.scales.t().contiguous(), None, "int8_grouped", 16)
    q4 = _weight("int4", 8, 64, seed=3, group_size=32)  # int4 is held as words: int4_matmul
    with pytest.raises(ValueError, match=r"quant_matmul \(triton\) quantization must be one of 'int8', "
                                         r"'int8_grouped'; got 'int4'"):
        qk.quant_matmul(x, *q4, "int4", 32)


@pytest.mark.parametrize("use_dot", [False, True])
def test_kernel_with_group_32_no_bias_and_one_split(use_dot):
    cfg = _check_kernel("int8_grouped", 3, torch.float32, use_dot, seed=23, n=16, k=256, group_size=32, bias=False)
    qw = _weight("int8_grouped", 16, 256, 29, torch.float32, group_size=32)
    x, _ = _inputs(3, 256, 16, 29, torch.float32)
    one = qk.quant_matmul(x, *qw, "int8_grouped", 32, config=dataclasses.replace(cfg, split_k=1))
    torch.testing.assert_close(one, ref.quant_matmul(x, *qw, "int8_grouped", 32), rtol=1e-5, atol=1e-5)


def test_split_k_tickets_reset_themselves_and_results_repeat_bit_for_bit():
    qw = _weight("int8", N_ODD, K, seed=31)
    x, bias = _inputs(2, K, N_ODD, seed=31, dtype=torch.float32)
    first = qk.quant_matmul(x, *qw, "int8", bias=bias)
    assert int(ticket_counters(x.device, 1).abs().sum()) == 0
    assert torch.equal(qk.quant_matmul(x, *qw, "int8", bias=bias), first)


# ---------------------------------------------------------------------------------------------------------------
# the one- and two-row int4 GEMV (interpreter)
# ---------------------------------------------------------------------------------------------------------------

_GEMV_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2 ** -7}


@pytest.mark.parametrize("m, dtype, group_size, n, k, bias, config", [
    (1, torch.float32, 128, N_ODD, K, True, None),  # the plan: outputs masked, several splits
    (2, torch.float32, 32, 256, 256, False, qg.Int4GemvConfig(128, 1, 4, 3)),  # even N, ragged splits (8 / 3)
    (1, torch.bfloat16, 128, 128, 512, True, qg.Int4GemvConfig(128, 1, 8, 1)),  # one split: no tickets
    (2, torch.float16, 64, 200, 256, True, qg.Int4GemvConfig(128, 1, 8, 4)),
    (2, torch.bfloat16, 256, 64, 512, False, None),
    (2, torch.float32, 128, N_ODD, K, True, qg.Int4GemvConfig(128, 1, 8, 1))])
def test_int4_gemv_matches_the_reference(m, dtype, group_size, n, k, bias, config):
    _check_k_major_kernel(qg.int4_gemv, _GEMV_TOL, m, dtype, group_size, n, k, bias, config)


def _check_k_major_kernel(kernel, tol, m, dtype, group_size, n, k, bias, config):
    """``kernel`` (``int4_gemv`` or ``int4_words_matmul``) on a random int4 weight packed into K-major words, against
    the reference on the checkpoint layout, to ``tol[dtype]`` of the largest output; its tickets reset themselves and
    a second call repeats the result bit for bit."""
    seed = zlib.crc32(f"{kernel.__name__} {m} {dtype} {group_size} {n} {k}".encode()) % 1000
    qw = _weight("int4", n, k, seed, dtype, group_size)
    x, b = _inputs(m, k, n, seed, dtype)
    b = b if bias else None
    words = ref.pack_int4_k_major(qw.qweight, group_size)
    zeros = _held_zeros(qw.zeros, dtype)
    got = kernel(x, words, qw.scales, zeros, group_size, b, config=config)
    f32 = lambda t: None if t is None else t.float()  # noqa: E731
    want = ref.quant_matmul(x.float(), qw.qweight, qw.scales.float(), qw.zeros.float(), "int4", group_size, f32(b))
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.float() - want).abs().max().item() / want.abs().max().item()
    assert err <= tol[dtype], err
    assert int(ticket_counters(x.device, 8).abs().sum()) == 0  # the tickets reset themselves
    assert torch.equal(kernel(x, words, qw.scales, zeros, group_size, b, config=config), got)


def _held_zeros(zeros, dtype):
    """Round-to-nearest's integer zero points as a layer holds them: bytes for the bf16 cases, the float dtype for
    the others (the kernels read both)."""
    return zeros.to(torch.uint8) if dtype == torch.bfloat16 else zeros


# ---------------------------------------------------------------------------------------------------------------
# several rows of int4 on tensor cores, over the GEMV's words (interpreter)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, dtype, group_size, n, k, bias, config", [
    (5, torch.float32, 128, N_ODD, K, True, None),  # the plan: outputs and rows masked, several splits
    (16, torch.bfloat16, 128, 64, 256, False, None),
    (3, torch.float16, 128, 70, 384, True, qwords.Int4WordsConfig(16, 32, 2, slabs=False)),  # one dot per group
    (17, torch.float16, 32, 70, 320, False, qwords.Int4WordsConfig(16, 32, 3, slabs=False, swap_ab=False)),
    (9, torch.float32, 128, 64, 256, True, qwords.Int4WordsConfig(16, 32, 1, swap_ab=False)),  # no tickets
    (40, torch.bfloat16, 64, 96, 256, True, qwords.Int4WordsConfig(32, 64, 4, slabs=False)),  # two row tiles
    (130, torch.bfloat16, 128, 128, 256, False, qwords.Int4WordsConfig(128, 128, 2, num_warps=8))])  # 128-row tiles
def test_int4_words_matmul_matches_the_reference(m, dtype, group_size, n, k, bias, config):
    _check_k_major_kernel(qwords.int4_words_matmul, _TOL, m, dtype, group_size, n, k, bias, config)


def test_int4_words_matmul_plans_row_tiles_and_enough_programs():
    for m in (2, 5, 16, 17, 64):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
            cfg = qwords.plan_int4_words_matmul(m, n, k, 128)
            assert cfg.block_m == min(64, max(16, 1 << (m - 1).bit_length())) and cfg.slabs
            assert 1 <= cfg.split <= k // 128
            tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
            programs = PROGRAMS_PER_SM * 132 // (1 if m <= 16 else 2)
            if m <= 16 and cfg.block_n == 128 and -(-n // 128) < programs:  # gate/up: split twice as finely
                programs *= 2
            assert tiles * cfg.split >= min(programs, tiles * (k // 128))
            assert cfg.split == 1 or tiles * (cfg.split - 1) < programs  # no more splits than that needs
    assert not qwords.plan_int4_words_matmul(8, 4096, 4096, 64).slabs  # 8 word rows per group: too few for a dot


def test_int4_words_matmul_rejects_bad_arguments_naming_them():
    qw = _weight("int4", 16, 256, seed=43)
    words = ref.pack_int4_k_major(qw.qweight, 128)
    with pytest.raises(ValueError, match=r"int4_words_matmul: x must be \[M, K\], got shape \(256,\)"):
        qwords.int4_words_matmul(torch.randn(256), words, qw.scales, qw.zeros)
    with pytest.raises(ValueError, match=r"int4_words_matmul: words must be int32 \[K // 8, N\]"):
        qwords.int4_words_matmul(torch.randn(2, 256), words.t().contiguous(), qw.scales, qw.zeros)
    with pytest.raises(ValueError, match=r"slabs need group_size >= 128 .*got 64"):
        qw64 = _weight("int4", 16, 256, seed=44, group_size=64)
        qwords.int4_words_matmul(torch.randn(2, 256), ref.pack_int4_k_major(qw64.qweight, 64), qw64.scales,
                                 qw64.zeros, 64, config=qwords.Int4WordsConfig(16, 32, 1, slabs=True))


@pytest.mark.parametrize("method, group_size, n, k", [
    ("int8", 128, N_ODD, 300), ("int8_grouped", 16, 65, 272), ("int8_grouped", 32, 64, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_dequantize_kernel_gives_the_references_values_exactly(method, group_size, n, k, dtype):
    """Every format it reads, partial tiles in both directions (N and K not multiples of the block), every dtype: the
    kernel's float weight equals the reference's bit for bit (float32 math, one rounding, no contraction), but for
    the interpreter's bf16 casts, which truncate where a GPU rounds to nearest: there, within one unit in the last
    place."""
    qw = _weight(method, n, k, zlib.crc32(f"deq {method} {group_size} {dtype}".encode()) % 1000, dtype, group_size)
    got = qk.dequantize(*qw, method, group_size, dtype)
    want = ref.dequantize(*qw, method, group_size, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)
    if method != "int8":  # scales handed over as a transposed view read the same values
        view = qw.scales.t().contiguous().t()
        assert torch.equal(qk.dequantize(qw.qweight, view, None, method, group_size, dtype), got)


@pytest.mark.parametrize("group_size, n, k", [(128, 300, 384), (32, 70, 320), (64, 256, 128), (256, 37, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_k_major_dequantize_kernel_gives_the_references_transposed_weight(group_size, n, k, dtype):
    """From the GEMV's words, every group size, N a partial tile: the kernel's ``[K, N]`` weight equals the
    reference's bit for bit (one bf16 unit under the interpreter, as above), which is the transposed weight of
    the checkpoint layout it was packed from."""
    qw = _weight("int4", n, k, zlib.crc32(f"deq-k {group_size} {n} {dtype}".encode()) % 1000, dtype, group_size)
    words = ref.pack_int4_k_major(qw.qweight, group_size)
    got = qwords.dequantize_k_major(words, qw.scales, _held_zeros(qw.zeros, dtype), group_size, dtype)
    want = ref.dequantize_k_major(words, qw.scales, qw.zeros, group_size, dtype)
    assert got.dtype == dtype and got.shape == (k, n) and got.is_contiguous()
    assert torch.equal(want, ref.dequantize(*qw, "int4", group_size, dtype).t())
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=rf"dequantize_k_major: zeros must be \[{k // group_size}, {n}\]"):
        qwords.dequantize_k_major(words, qw.scales, qw.zeros[:, 1:], group_size, dtype)


def test_int4_gemv_plans_whole_groups_and_enough_programs():
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (576, 1536)):
        cfg = qg.plan_int4_gemv(n, k, 128)
        assert cfg.block_n == 128 * cfg.num_warps and cfg.rows == 8 and 1 <= cfg.split <= k // 128
        programs = -(-n // cfg.block_n) * cfg.split
        assert programs >= min(qg.GEMV_PROGRAMS_PER_SM * 132, -(-n // cfg.block_n) * (k // 128))
    assert qg.plan_int4_gemv(4096, 4096, 32).rows == 4


def test_int4_gemv_rejects_bad_arguments_naming_them():
    qw = _weight("int4", 16, 256, seed=41)
    words = ref.pack_int4_k_major(qw.qweight, 128)
    with pytest.raises(ValueError, match=r"int4_gemv takes 1 to 2 rows, x \[M, K\]; got shape \(3, 256\)"):
        qg.int4_gemv(torch.randn(3, 256), words, qw.scales, qw.zeros)
    with pytest.raises(ValueError, match=r"words must be int32 \[K // 8, N\] = \[32, N\], got torch.int32 \(16, 32\)"):
        qg.int4_gemv(torch.randn(1, 256), words.t().contiguous(), qw.scales, qw.zeros)
    with pytest.raises(ValueError, match=r"group_size must be one of \(32, 64, 128, 256\) dividing K=256, got 48"):
        qg.int4_gemv(torch.randn(1, 256), words, qw.scales, qw.zeros, 48)
    with pytest.raises(ValueError, match=r"zeros must be \[2, 16\], got \(16, 2\)"):
        qg.int4_gemv(torch.randn(1, 256), words, qw.scales, qw.zeros.t())
