"""benchmarks/decode_walk.py: one decode step's files, the engine's room first, the attention path among them."""

from benchmarks import decode_walk


def test_one_decode_step_enters_the_engine_the_runner_the_model_and_the_decode_step():
    files = dict(decode_walk.walk_one_decode_step())
    assert next(iter(files)) == "questkv/engine/llm_engine.py" and files["questkv/engine/llm_engine.py"] == 1
    for path in ("questkv/engine/model_runner.py", "questkv/models/llama.py", "questkv/layers/attention.py",
                 "questkv/decode/step.py", "questkv/decode/route.py"):
        assert files[path] >= 1, path
    assert all(count >= 1 for count in files.values())
