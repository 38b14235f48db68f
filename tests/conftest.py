import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Keep multi-process tests on CPU and quiet.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `make test` runs the modules in several pytest-xdist workers at once: a process group started without a launcher
# (one process, DeepSpeed's default port 29500) would then take the same port in two workers. Each worker gets a
# port of its own; tests and launches that choose their port still set it themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


@pytest.fixture
def examples() -> Path:
    return ROOT / "migration_examples"


def pytest_collection_modifyitems(config, items):
    """Multi-process modules (marked slow) first: under ``make test``'s workers (``--dist loadfile``, modules handed
    out in this order) the long ones start at once and the short ones fill the gaps, instead of one long module
    starting last while the other workers sit idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order is kept


@pytest.fixture(autouse=True)
def _no_process_group_left_running():
    """A test that starts a process group in the pytest process stops it: one left running changes what the next
    test in the same worker sees (``zero.Init`` does not start one, the engine does not choose its backend)."""
    dist = sys.modules.get("torch.distributed")
    before = dist is not None and dist.is_available() and dist.is_initialized()
    yield
    dist = sys.modules.get("torch.distributed")
    if not before and dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group running in the pytest process")


@pytest.fixture(autouse=True)
def _functional_linear_restored():
    """``deepspeed.zero.Init`` replaces ``torch.nn.functional.linear`` for the rest of the process, as DeepSpeed's
    does: a test that enters it in the pytest process must not change ``F.linear`` for the tests after it."""
    functional = sys.modules.get("torch.nn.functional")
    before = functional.linear if functional is not None else None
    yield
    functional = sys.modules.get("torch.nn.functional")
    if functional is not None and before is not None and functional.linear is not before:
        functional.linear = before
    pp = sys.modules.get("torsh.compat.deepspeed.runtime.zero.partition_parameters")
    keeper = getattr(pp, "InsertPostInitMethodToModuleSubClasses", None)
    if keeper is not None and "linear_bk" in vars(keeper):
        del keeper.linear_bk


@pytest.fixture(autouse=True)
def _deepspeed_group_caches_cleared():
    """DeepSpeed's ``utils.groups`` (real and drop-in) caches the process groups of the first ``initialize``; a test
    that ran one in the pytest process and then stopped its process group leaves groups of a dead process group in
    the cache, and ranks later forked from this process would use them. Each test that ran one drops them after."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return  # a group still running (a module-scoped one): its groups are still good
    for name in ("deepspeed.utils.groups", "torsh.compat.deepspeed.utils.groups"):
        groups = sys.modules.get(name)
        for attr, value in list(vars(groups).items()) if groups is not None else ():
            if attr == "mpu" or (attr.startswith("_") and attr.isupper() and ("GROUP" in attr or "_MPU_" in attr)):
                if isinstance(value, dict):
                    value.clear()
                elif value is not None and not callable(value) and not isinstance(value, str):
                    setattr(groups, attr, None)
