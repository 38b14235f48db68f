"""``deepspeed.utils.torch``: torch version checks (``required_torch_version``) and
``register_grad_hook``, as DeepSpeed has them."""

from __future__ import annotations


def _version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the installed torch's ``major.minor`` is within ``[min_version, max_version]`` (numbers like
    ``2.1``, as DeepSpeed takes them)."""
    assert min_version or max_version, "Must provide a min_version or max_version argument"
    current = _version()

    def parse(value) -> tuple[int, int]:
        major, _, minor = str(value).partition(".")
        return int(major), int(minor or 0)

    if min_version and current < parse(min_version):
        return False
    if max_version and current > parse(max_version):
        return False
    return True


def register_grad_hook(param, hook):
    """Call ``hook(param)`` after ``param``'s gradient is accumulated (torch's post-accumulate hook)."""
    return param.register_post_accumulate_grad_hook(hook)
