import os

# Triton kernels run on CPU tensors under the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
