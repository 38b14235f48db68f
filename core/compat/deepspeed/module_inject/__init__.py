"""``deepspeed.module_inject``: of DeepSpeed's kernel injection and AutoTP, the ``tp_shard`` helpers (how a
dimension is shared out over a tensor- or sequence-parallel group). torsh splits models for tensor parallelism
itself (``tensor_parallel`` in the config) and injects no kernels."""


def __getattr__(name: str):
    if name == "tp_shard":
        import importlib

        return importlib.import_module(f"{__name__}.tp_shard")
    raise AttributeError(f"deepspeed.module_inject.{name} is not provided by torsh's DeepSpeed compatibility package "
                         "(it injects no kernels; set tensor_parallel in the config for AutoTP's split): only "
                         "module_inject.tp_shard is; docs/torsh-run.md lists the DeepSpeed API torsh covers")
