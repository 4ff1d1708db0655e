"""questkv.eval.harness on a tiny random Llama (fp32, CPU): batched prefill + decode vs one row at a
time and vs plain transformers, teacher-forced NLL vs one dense forward, settings and snapshots."""

import copy
import math
import random

import pytest
import torch

from questkv import QuestConfig
from questkv.eval import harness
from questkv.eval.harness import Setting
from questkv.policies import DecodePolicy, H2OPolicy, QuestTopPPolicy, StreamingPolicy

PAGE = 8
DENSE_LAYERS = 1


def random_rows(rng, vocab, lengths):
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def run(model, setting, contexts, tails, max_new, eos=None):
    harness.enable_setting(model, setting, PAGE, DENSE_LAYERS)
    collect = setting.policy == "h2o"
    cache, positions = harness.prefill(model, contexts, PAGE, collect_prefill_attention=collect)
    return harness.decode_greedy(model, cache, positions, tails, max_new, eos), cache


@pytest.mark.parametrize(
    "setting", [Setting("full", None), Setting("quest", 16), Setting("h2o", 12), Setting("quest-topp", 16, (("top_p", 0.8),))],
    ids=lambda s: s.label,
)
def test_batch_decodes_every_row_as_alone(tiny_model, setting):
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    contexts = random_rows(rng, vocab, [57, 23, 40])
    tails = random_rows(rng, vocab, [1, 5, 3])
    max_new = [4, 2, 6]
    together, cache = run(tiny_model, setting, contexts, tails, max_new)
    assert [len(out) for out in together] == max_new
    if setting.policy != "full":
        assert cache.mean_tokens_attended <= setting.budget
    for row in range(3):
        alone, _ = run(tiny_model, setting, [contexts[row]], [tails[row]], [max_new[row]])
        assert together[row] == alone[0], f"row {row}"


def test_full_setting_equals_plain_transformers_greedy(tiny_model):
    reference = copy.deepcopy(tiny_model)  # never enabled
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    contexts = random_rows(rng, vocab, [44, 18])
    tails = random_rows(rng, vocab, [4, 2])
    max_new = [6, 3]
    plain = []
    for context, tail, n in zip(contexts, tails, max_new):
        ids = torch.tensor([context + tail])
        out = reference.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        plain.append(out[0, ids.shape[1]:].tolist())
    outputs, _ = run(tiny_model, Setting("full", None), contexts, tails, max_new)
    assert outputs == plain
    # EOS: a row stops right before its EOS token (excluded); the others are unaffected.
    eos = plain[0][2]
    if eos in plain[0][:2]:
        return
    outputs, _ = run(tiny_model, Setting("full", None), contexts, tails, max_new, eos=eos)
    expected = [row[: row.index(eos)] if eos in row else row for row in plain]
    assert outputs == expected and len(outputs[0]) == 2


def dense_nll(model, contexts, targets):
    """``[batch, n]`` float64: NLL of ``targets[:, 1:]`` from one dense forward per row."""
    rows = []
    with torch.no_grad():
        for context, target in zip(contexts, targets.tolist()):
            ids = torch.tensor([context + target])
            log_probs = torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)
            start = len(context)  # logits at position p predict token p + 1
            picked = [-log_probs[start + i, target[i + 1]] for i in range(len(target) - 1)]
            rows.append(torch.stack(picked))
    return torch.stack(rows)


def test_score_tokens_under_full_is_the_dense_nll(tiny_model):
    reference = copy.deepcopy(tiny_model)
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    contexts = random_rows(rng, vocab, [35, 50])
    targets = torch.tensor(random_rows(rng, vocab, [9, 9]))
    expected = dense_nll(reference, contexts, targets)
    harness.enable_setting(tiny_model, Setting("full", None), PAGE, DENSE_LAYERS)
    cache, positions = harness.prefill(tiny_model, contexts, PAGE)
    assert positions.tolist() == [35, 50]
    nll = harness.score_tokens(tiny_model, cache, positions, targets)
    assert nll.shape == (2, 8) and nll.dtype == torch.float64
    torch.testing.assert_close(nll, expected, atol=1e-4, rtol=0)
    assert harness.perplexity(nll) == pytest.approx(math.exp(float(expected.mean())), rel=1e-4)
    assert harness.perplexity(nll) == math.exp(float(nll.mean()))
    # A small sparse budget goes through the decode path and changes the NLL.
    harness.enable_setting(tiny_model, Setting("streaming", 8), PAGE, DENSE_LAYERS)
    cache, positions = harness.prefill(tiny_model, contexts, PAGE)
    sparse = harness.score_tokens(tiny_model, cache, positions, targets)
    assert (sparse - expected).abs().max() > 1e-5
    assert cache.mean_tokens_attended == 8


def test_setting_build():
    full = Setting("full", None).build(PAGE, 2)
    assert full == QuestConfig(token_budget=None, page_size=PAGE, dense_layers=2, dense_context_ratio=1.0)
    quest = Setting("quest", 32, (("selection", "q_head"),)).build(PAGE, 1)
    # an evaluation measures Quest's answers at every context: the route's cost model off (dense_context_ratio 1)
    assert quest == QuestConfig(token_budget=32, page_size=PAGE, dense_layers=1, selection="q_head",
                                dense_context_ratio=1.0)
    h2o = Setting("h2o", 24, (("recent_tokens", 4),)).build(PAGE, 1)
    assert isinstance(h2o, H2OPolicy) and h2o.token_budget == 24 and h2o.recent_tokens == 4 and h2o.page_size == PAGE
    topp = Setting("quest-topp", 32, (("top_p", 0.5),)).build(PAGE, 1)
    assert isinstance(topp, QuestTopPPolicy) and topp.top_p == 0.5 and topp.config.budget_pages == 4
    streaming = Setting("streaming", 16).build(PAGE, 1)
    assert isinstance(streaming, StreamingPolicy) and isinstance(streaming, DecodePolicy)
    assert Setting("full", None).label == "full" and Setting("h2o", 24).label == "h2o@24"


@pytest.mark.parametrize(
    "setting,message",
    [
        (Setting("full", 64), "full takes none"),
        (Setting("quest", None), "quest needs one"),
        (Setting("bogus", 64), "Setting.policy must be one of 'full', .*; got 'bogus'"),
        (Setting("quest", 64, (("top_p", 0.9),)), "takes no option"),
        (Setting("full", None, (("sink_tokens", 1),)), "takes no option"),
        (Setting("h2o", 64, (("selection", "q_head"),)), "takes no option"),
        (Setting("quest", 12), "multiple of"),
        (Setting("oracle", 12), "multiple of"),
    ],
)
def test_setting_build_rejects_bad_combinations(setting, message):
    with pytest.raises(ValueError, match=message):
        setting.build(PAGE, 1)


@pytest.mark.parametrize("setting", [Setting("quest", 16), Setting("h2o", 12)], ids=lambda s: s.label)
def test_snapshots_are_independent(tiny_model, setting):
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    contexts = random_rows(rng, vocab, [41, 30])
    tails = random_rows(rng, vocab, [3, 2])
    harness.enable_setting(tiny_model, setting, PAGE, DENSE_LAYERS)
    cache, positions = harness.prefill(tiny_model, contexts, PAGE, collect_prefill_attention=True)
    lengths = [cache.paged.seq_len(seq) for seq in cache.seq_ids]
    assert lengths == [41, 30]
    first = harness.snapshot(cache)
    out_first = harness.decode_greedy(tiny_model, first, positions, tails, [5, 5], None)
    # decoding the copy changed neither the original nor the position tensor it was given
    assert [cache.paged.seq_len(seq) for seq in cache.seq_ids] == lengths
    assert cache.get_seq_length() == 41 and cache.policy_states == {} and cache.sparse_steps == 0
    assert positions.tolist() == [41, 30]
    steps = 3 + 5 - 1  # the longest row: its tail, then 5 tokens of which the last is never fed
    assert [first.paged.seq_len(seq) for seq in first.seq_ids] == [41 + steps, 30 + steps]
    second = harness.snapshot(cache)
    out_second = harness.decode_greedy(tiny_model, second, positions, tails, [5, 5], None)
    assert out_second == out_first
    assert second.mean_tokens_attended == first.mean_tokens_attended
    # and the original itself still decodes the same
    assert harness.decode_greedy(tiny_model, cache, positions, tails, [5, 5], None) == out_first


@pytest.mark.parametrize("rows, width, limit", [(20, 32768, 2**33), (20, 16384, 2**33), (3, 57, 3 * 57 * 10),
                                               (2, 5, 1), (1, 3, 1), (1, 1, 1)])
def test_prefill_chunks_cover_the_columns_within_the_limit(rows, width, limit):
    chunks = harness.prefill_chunks(rows, width, limit)
    assert chunks[0][0] == 0 and chunks[-1][1] == width
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(end - start >= 2 for start, end in chunks) or len(chunks) == 1
    if rows * 2 * width <= limit:  # chunks of 2 columns fit: every chunk does
        assert all(rows * (end - start) * width <= limit for start, end in chunks)
    if rows * width * width <= limit:
        assert chunks == [(0, width)]


@pytest.mark.parametrize("setting", [Setting("full", None), Setting("quest", 16), Setting("h2o", 12)],
                         ids=lambda s: s.label)
def test_a_chunked_prefill_decodes_as_one_forward(tiny_model, setting):
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    contexts = random_rows(rng, vocab, [61, 38, 50])
    tails = random_rows(rng, vocab, [2, 4, 1])
    harness.enable_setting(tiny_model, setting, PAGE, DENSE_LAYERS)
    collect = setting.policy == "h2o"
    whole, positions = harness.prefill(tiny_model, contexts, PAGE, collect_prefill_attention=collect)
    limit = 3 * 61 * 15  # chunks of at most 15 columns: 5 of them
    assert len(harness.prefill_chunks(3, 61, limit)) == 5
    chunked, chunked_positions = harness.prefill(tiny_model, contexts, PAGE, collect_prefill_attention=collect,
                                                 max_elements=limit)
    assert torch.equal(positions, chunked_positions)
    def stored(cache, layer):  # [rows, stored tokens, kv heads, head_dim] keys and values, in order
        pages = cache.paged.layer(layer)
        table, lens = cache.paged.batch(cache.seq_ids)
        out = []
        for source in (pages.k_pages, pages.v_pages):
            tokens = source[table.long()].flatten(1, 2)
            out.append([tokens[row, : int(n)] for row, n in enumerate(lens)])
        return out

    for layer in range(tiny_model.config.num_hidden_layers):
        for rows_a, rows_b in zip(stored(whole, layer), stored(chunked, layer)):
            for a, b in zip(rows_a, rows_b):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        if collect:
            torch.testing.assert_close(chunked.prefill_attention[layer], whole.prefill_attention[layer],
                                       atol=1e-5, rtol=1e-5)
    max_new = [5, 3, 4]
    assert (harness.decode_greedy(tiny_model, chunked, positions, tails, max_new, None)
            == harness.decode_greedy(tiny_model, whole, positions, tails, max_new, None))


def test_prefill_rejects_empty_rows(tiny_model):
    harness.enable_setting(tiny_model, Setting("full", None), PAGE, DENSE_LAYERS)
    with pytest.raises(ValueError, match="no empty context"):
        harness.prefill(tiny_model, [[3, 4, 5], []], PAGE)
    with pytest.raises(ValueError, match="at least one row"):
        harness.prefill(tiny_model, [], PAGE)


def test_decode_greedy_row_without_new_tokens(tiny_model):
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    contexts = random_rows(rng, vocab, [30, 26])
    tails = random_rows(rng, vocab, [2, 4])
    outputs, cache = run(tiny_model, Setting("quest", 16), contexts, tails, [0, 3])
    alone, _ = run(tiny_model, Setting("quest", 16), [contexts[1]], [tails[1]], [3])
    assert outputs == [[], alone[0]]
    assert cache.get_seq_length() == 30 + 4 + 3 - 1  # the batch ran as long as its longest row
    harness.enable_setting(tiny_model, Setting("full", None), PAGE, DENSE_LAYERS)
    cache, positions = harness.prefill(tiny_model, contexts, PAGE)
    with pytest.raises(ValueError, match="non-empty tail"):
        harness.decode_greedy(tiny_model, cache, positions, [tails[0], []], [2, 2], None)
    with pytest.raises(ValueError, match="max_new_tokens >= 0"):
        harness.decode_greedy(tiny_model, cache, positions, tails, [2, -1], None)
