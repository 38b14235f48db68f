"""``deepspeed.sequence``: DeepSpeed-Ulysses sequence parallelism (:class:`layer.DistributedAttention`). FPDT
(``fpdt_layer``, DeepSpeed's chunked CUDA attention with host offloading) imports and says it is not run."""
