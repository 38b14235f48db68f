"""``deepspeed.runtime.swap_tensor``: the sizes DeepSpeed's NVMe swapping is built around.

torsh does not swap tensors to NVMe (``offload_*.device: nvme`` is refused where it is configured); scripts and
tests import these constants to size models and buffers, so they hold DeepSpeed's values.
"""

MIN_AIO_BYTES = 1024**2
"""The smallest transfer DeepSpeed's asynchronous I/O handles in one request (1 MiB)."""

AIO_ALIGNED_BYTES = 1024
"""The alignment of DeepSpeed's swap buffers."""

MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES
"""The smallest tensor DeepSpeed swaps to NVMe; smaller ones stay in memory."""
