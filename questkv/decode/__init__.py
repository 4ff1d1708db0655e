"""The Quest decode step (estimate -> select -> attend) above the page cache, shared by the HF
drop-in, the engine and the benchmarks."""

from questkv.decode.step import QuestDecodeStep, quest_decode

__all__ = ["QuestDecodeStep", "quest_decode"]
