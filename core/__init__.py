"""torsh-distributed: one typed model for distributed-training configs, and an engine that runs them.

Importing ``torsh`` (and ``torsh.config``, ``torsh.adapters``) never imports torch; the engine and
``torsh.initialize`` load it on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"
