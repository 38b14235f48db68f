"""``deepspeed.monitor``: DeepSpeed's metric writers (TensorBoard, CSV, Weights & Biases, Comet) and their config
sections, for scripts that build them from a config or log their own events through them.

``MonitorMaster(get_monitor_config(config_dict))`` writes ``(name, value, step)`` events to every enabled writer on
rank 0, as the engine's ``engine.monitor`` does. The CSV files and TensorBoard scalars are written by the torsh
engine's writers (:mod:`torsh.engine.monitor`), so a script's events and the engine's land in the same files.
"""
