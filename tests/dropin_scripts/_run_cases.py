"""Run several drop-in scripts, one after the other, in the ranks of one launch: ``<launcher> --nproc-per-node 2
_run_cases.py SPEC``. SPEC is a JSON list of ``{"name", "script", "args", "cwd"}`` and optionally ``"env"``
(variables of that case only); each script runs unchanged as ``__main__`` (``runpy``), with the ``sys.argv``,
working directory and variables its own launch would give it, and writes its record as it does when launched alone.

Between two scripts the state a fresh process would not have is put back: the environment variables and the
random generators (torch, Python, NumPy) as they were when this runner started, Accelerate's and Transformers'
process-wide state, and TorchDynamo's compiled code. The process group stays (DeepSpeed keeps its groups in module
state): the scripts initialise it only when none exists, as they do in their own launch (a script that works
differently when a group exists, such as one saving per-rank files, checks for one); the harness puts one that
destroys its group last. A script that raises
ends the launch (its peers would wait in a collective otherwise); the harness tells the failed case from the
records written and runs the remaining ones in a new launch.
"""

import gc
import json
import os
import random
import runpy
import sys


def _rng_state():
    import torch

    state = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _restore(state):
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _reset_libraries():
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if "transformers.integrations.deepspeed" in sys.modules:
        sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    gc.collect()


def main(spec_path):
    with open(spec_path) as f:
        cases = json.load(f)
    fresh = _rng_state()
    for case in cases:
        _restore(fresh)
        environ = dict(os.environ)
        os.environ.update(case.get("env", {}))
        os.chdir(case["cwd"])
        sys.argv = [case["script"], *case["args"]]
        try:
            runpy.run_path(case["script"], run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        os.environ.clear()  # the environment as the launcher gave it, without what the case or its libraries set
        os.environ.update(environ)
        _reset_libraries()


if __name__ == "__main__":
    main(sys.argv[1])
