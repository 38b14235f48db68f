"""Checkpoints: torsh's own (``save_load``, DCP shards in DeepSpeed's directory convention, over ``io`` and
``state``), DeepSpeed's read into the engine (``from_deepspeed``), one full state dict from either (``merge``), and
the ``zero_to_fp32.py`` written beside them (``recovery_script``)."""
