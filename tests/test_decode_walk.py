"""benchmarks/decode_walk.py: one decode step's files, the engine's room first, the attention path among them, and
its call chains into the ops backend."""

from benchmarks import decode_walk


def test_one_decode_step_enters_the_engine_the_runner_the_model_and_the_decode_step():
    files, chains = decode_walk.walk_one_decode_step()
    files = dict(files)
    assert next(iter(files)) == "questkv/engine/llm_engine.py" and files["questkv/engine/llm_engine.py"] == 1
    for path in ("questkv/engine/model_runner.py", "questkv/models/llama.py", "questkv/layers/attention.py",
                 "questkv/decode/step.py", "questkv/decode/route.py"):
        assert files[path] >= 1, path
    assert all(count >= 1 for count in files.values())
    attention = ("questkv/engine/llm_engine.py", "questkv/engine/model_runner.py", "questkv/models/llama.py",
                 "questkv/layers/attention.py", "questkv/decode/step.py", "questkv/ops/reference.py")
    assert attention in chains  # the eager step calls its body directly: the runner is entered once
    assert all(chain[0] == "questkv/engine/llm_engine.py" and chain[-1] == "questkv/ops/reference.py"
               for chain in chains)
    assert all(set(chain) <= set(files) for chain in chains)
