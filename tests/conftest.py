import os

# Triton kernels run on CPU tensors under the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# Test tensors are tiny and pytest-xdist already runs one worker per core: a second intra-op thread
# only adds contention (tens of ms per op on a busy 2-core machine instead of microseconds).
torch.set_num_threads(1)
