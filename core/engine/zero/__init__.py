"""Data parallelism and sharding: DDP (stage 0), DeepSpeed's ZeRO-1/2 partition (``partition``), FSDP2 for ZeRO-3
and HSDP (``sharding``), the FSDP2 units planned from DeepSpeed's bucket sizes (``units``, ``wrap``, ``leaves``) and
DeepSpeed's per-parameter ZeRO attributes (``params``, ``whole_params``)."""
