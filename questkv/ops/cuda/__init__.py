"""Kernels in CUDA C++, built at first use where Triton cannot express what they do (:mod:`.int4_mma`)."""
