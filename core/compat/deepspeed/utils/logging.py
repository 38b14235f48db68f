"""``deepspeed.utils.logging``: ``logger`` and ``log_dist``."""

from . import log_dist, log_dist_once, logger, set_log_level_from_string  # noqa: F401
