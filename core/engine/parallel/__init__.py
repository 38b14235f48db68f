"""Model parallelism on a DeviceMesh beside data parallelism: tensor parallelism (``tensor_parallel``); MoE expert
parallelism and sequence parallelism belong here when they arrive."""
