"""Tensor parallelism's communicator: :class:`~questkv.distributed.group.TensorParallel`, one rank's place in the
group and the collectives the sharded layers run. The sharded layers are :mod:`questkv.layers.parallel`'s, the
worker processes and their watchdog :mod:`questkv.engine.tp_workers`'."""
