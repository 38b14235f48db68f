"""``deepspeed.runtime.sequence_parallel``: the sequence-parallel process groups (``parallel_state_sp``), a
Megatron-style ``mpu`` for DeepSpeed-Ulysses."""
