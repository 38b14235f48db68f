"""Constants of the ZeRO-1/2 flat partition (:mod:`torsh.engine.zero.partition`) that modules the partition itself
imports also read (its DeepSpeed views, the optimizers that gather a parameter from the partition), kept apart so
that they need not import the partition."""

ALIGNMENT = 2
"""Each rank's chunk of a bucket is a multiple of this many elements, so that in a 2-byte dtype every chunk starts
4-byte aligned (DeepSpeed's ``nccl_start_alignment_factor``)."""

ZERO_SLOT = "_torsh_zero_slot"
"""The attribute of a partitioned parameter: ``(partition, bucket, offset)`` (what ``deepspeed.utils``'s
``safe_get_full_*`` helpers read)."""
