"""Tensor parallelism's process side: the ranks' communicator (:mod:`.group`) and the worker processes of ranks
1..N-1 with their watchdog (:mod:`.workers`). The sharded layers live in :mod:`questkv.layers.parallel`."""
