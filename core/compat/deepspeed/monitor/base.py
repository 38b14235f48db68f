"""The ``Monitor`` base class every writer derives from (``deepspeed.monitor.monitor.Monitor``, re-exported there),
apart from ``MonitorMaster`` so that the writers need not import the module that imports them."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Monitor(ABC):
    """A metric writer built from its config section; ``write_events([(name, value, step), ...])``."""

    @abstractmethod
    def __init__(self, monitor_config):
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list):
        """Write ``(name, value, step)`` events."""
