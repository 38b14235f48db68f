"""``deepspeed.ops.aio``: DeepSpeed's asynchronous-I/O op builder under its import path (test files and libraries
import it to ask whether NVMe offload can run). torsh compiles no op: the builder reports it not installed, and
``load()`` refuses; it is compatible, as torsh runs NVMe offload without libaio."""

from ..op_builder import AsyncIOBuilder  # noqa: F401
