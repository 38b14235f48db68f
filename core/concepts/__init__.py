"""What the dialects mean, said once and torch-free: the knowledge every adapter and the engine plan share.

Each module is one concept: ``dtypes`` (every spelling of the three training dtypes). Adapters map their keys
onto these; the engine plan decides from them. Nothing here imports torch or an adapter.
"""
