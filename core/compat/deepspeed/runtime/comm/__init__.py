"""``deepspeed.runtime.comm``: DeepSpeed's collective helpers (:mod:`.coalesced_collectives`)."""
