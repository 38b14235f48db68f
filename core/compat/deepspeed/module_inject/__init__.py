"""``deepspeed.module_inject``: of DeepSpeed's kernel injection and AutoTP, the ``tp_shard`` helpers (how a
dimension is shared out over a tensor- or sequence-parallel group). torsh splits models for tensor parallelism
itself (``tensor_parallel`` in the config) and injects no kernels."""
