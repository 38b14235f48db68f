"""``deepspeed.runtime.zero.muon``: DeepSpeed's Muon with its auxiliary Adam (:mod:`.muon_optimizer`) and the Muon
step it is made of (:mod:`.original_muon`), on torsh's implementation (:mod:`torsh.engine.optimizers.muon`)."""
