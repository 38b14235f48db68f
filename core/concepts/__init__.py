"""What the dialects mean, said once and torch-free: the knowledge every adapter and the engine plan share.

One module per concept: ``dtypes`` (every spelling of the three training dtypes), ``precision`` (torch GradScaler
defaults and DeepSpeed's fp16/bf16 rules as data), ``optim`` (optimizer and scheduler name tables), ``offload``
(where each offload target lives), ``launch`` (launcher defaults and the variables workers read), ``sharding``
(each framework's words for the data-parallel layout: strategies, reshard switches, hybrid meshes). Adapters map
their keys onto these; the engine decides from them. Nothing here imports torch or an adapter.
"""
