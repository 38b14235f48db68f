"""Pipeline parallelism as DeepSpeed defines it: the layers of a ``PipelineModule`` partitioned, built and seeded
(``module``) over its process topology (``topology``), run by the pipeline engine (``engine``) on
``torch.distributed.pipelining``, with DeepSpeed's per-layer checkpoint layout (``checkpoint``)."""
