"""The execution engine: builds a running PyTorch job from the core model (imports torch)."""
