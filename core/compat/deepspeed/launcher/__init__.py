"""``deepspeed.launcher``: the names libraries import from DeepSpeed's launcher package (Accelerate's ``accelerate
launch`` reads ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME`` before it starts a DeepSpeed job). The
``deepspeed`` command itself is not provided: under torsh a job starts with ``torsh run`` (torchrun's options), and
``torsh-migrate launch "deepspeed ..." --to torchrun`` translates a deepspeed command line."""
