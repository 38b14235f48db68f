"""Performance measured side by side: torsh against hand-written PyTorch and DeepSpeed 0.19.8.

Run ``python -m benchmarks`` (or ``make bench``) from the repository root. Claims are ratios measured in one
run on one machine, never absolute times.
"""
