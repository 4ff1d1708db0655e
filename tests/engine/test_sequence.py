"""Sequence: slices of prompt, outputs and drafts in a row."""

import random

from questkv.engine.sequence import Sequence


def test_token_slice_equals_slicing_the_whole_sequence():
    seq = Sequence("a", [random.randrange(100) for _ in range(random.randint(1, 9))])
    seq.output_token_ids = [random.randrange(100) for _ in range(random.randint(0, 9))]
    seq.draft_token_ids = [random.randrange(100) for _ in range(random.randint(0, 5))]
    whole = seq.all_token_ids + seq.draft_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert seq.token_slice(start, end) == whole[start:end]
