"""``deepspeed.launcher.multinode_runner``: the command lines DeepSpeed 0.19.8's ``deepspeed`` command builds to start
a job on several nodes, one class per back-end (``--launcher``): pdsh, OpenMPI, MPICH, Intel MPI, Slurm, MVAPICH.

Each runner takes the launcher's parsed arguments (:func:`deepspeed.launcher.runner.parse_args`) and gives, from
``get_cmd(environment, active_resources)``, the argv DeepSpeed would run, with the variables added by
``add_export`` (a value with characters the shell would read is double-quoted). The lines are DeepSpeed's: the
MPI and Slurm ones start ``python -u <script>`` on every rank, so the script must find ``deepspeed`` there (under
torsh, start the job with ``torsh run``, or translate the whole command with ``torsh-migrate launch``); the pdsh
line starts DeepSpeed's per-node launcher (``deepspeed.launcher.launch``), which torsh does not provide. MPICH's
``get_cmd`` is refused (its line would run a per-rank helper script torsh does not ship). torsh itself never runs
these commands, and building them writes no file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from abc import ABC, abstractmethod
from shlex import split

from .constants import MVAPICH_TMP_HOSTFILE, PDSH_MAX_FAN_OUT

#: A value made only of these characters is exported as it is; anything else is double-quoted for the shell.
_PLAIN_VALUE = re.compile(r"[\w@%+=:,./-]*")


class MultiNodeRunner(ABC):
    """A back-end: its arguments checked (``validate_args``), the script's arguments as the back-end passes them
    (``user_arguments``), the variables to export to every rank (``exports``)."""

    def __init__(self, args, world_info_base64):
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self):
        """Whether the back-end's command is installed here."""

    @abstractmethod
    def get_cmd(self, environment, active_resources):
        """The command that starts the job."""

    def add_export(self, key, var) -> None:
        """Export ``key=var`` to every rank; ``var`` double-quoted when the shell would split or expand it."""
        var = var.strip()
        if not _PLAIN_VALUE.fullmatch(var):
            var = f'"{var}"'
        self.exports[key.strip()] = var

    def parse_user_args(self) -> list[str]:
        return self.args.user_args

    @property
    def name(self) -> str:
        return self.__class__.__name__

    def validate_args(self) -> None:
        """Refuse arguments the back-end cannot honour (ValueError)."""

    @classmethod
    def validate_active_resources(cls, active_resources) -> None:
        """Refuse an ``--include``/``--exclude`` result the back-end cannot express (ValueError)."""


def _python(args, *, module_flag: bool = True) -> list[str]:
    """``python -u`` (``-m`` with ``--module``) before the script, nothing with ``--no_python``."""
    if args.no_python:
        return []
    return [sys.executable, "-u", *(["-m"] if module_flag and args.module else [])]


class _MPIRunner(MultiNodeRunner):
    """The MPI back-ends: the whole hostfile, without per-device filters or node/device counts."""

    def __init__(self, args, world_info_base64, resource_pool):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def validate_args(self) -> None:
        super().validate_args()
        if self.args.include != "" or self.args.exclude != "":
            raise ValueError(f"{self.name} backend does not support worker include/exclusion")
        if self.args.num_nodes != -1 or self.args.num_gpus != -1:
            raise ValueError(f"{self.name} backend does not support limiting num nodes/gpus")

    def _per_node(self, label: str) -> tuple[int, int]:
        """(total processes, processes per node); every node must have the same count."""
        counts = list(self.resource_pool.values())
        if len(set(counts)) > 1:
            raise ValueError(f"{label} requires same number of devices per node")
        return sum(counts), counts[0]

    def _rendezvous_env(self, flag: str, total: int, per_node: int) -> list[str]:
        pairs = (("MASTER_ADDR", self.args.master_addr), ("MASTER_PORT", self.args.master_port),
                 ("WORLD_SIZE", total), ("LOCAL_SIZE", per_node))  # fmt: skip
        return [item for key, value in pairs for item in (flag, key, str(value))]

    def _hosts(self) -> list[str]:
        return ["-hosts", ",".join(self.resource_pool.keys())]


class PDSHRunner(MultiNodeRunner):
    """pdsh over ssh: DeepSpeed's per-node launcher on every host (``%n`` is pdsh's node number)."""

    def backend_exists(self):
        return shutil.which("pdsh")

    def parse_user_args(self) -> list[str]:
        # pdsh joins the command into one shell line: an argument with spaces is quoted to stay one argument
        return [f'"{arg.replace(chr(34), chr(92) + chr(34))}"' if " " in arg else arg for arg in self.args.user_args]

    @property
    def name(self) -> str:
        return "pdsh"

    def get_cmd(self, environment, active_resources):
        """(the pdsh command, the pdsh command that kills the job's launchers, ``environment`` with pdsh's
        variables)."""
        environment["PDSH_RCMD_TYPE"] = "ssh"
        if self.args.ssh_port is not None:
            environment["PDSH_SSH_ARGS_APPEND"] = (f"{environment.get('PDSH_SSH_ARGS_APPEND', '')} "
                                                   f"-p {self.args.ssh_port}")  # fmt: skip
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(active_resources.keys()),
                *split(self.args.launcher_args)]  # fmt: skip
        exports = "".join(f"export {key}={value}; " for key, value in self.exports.items())
        launch = [exports, f"cd {os.path.abspath('.')};", sys.executable, "-u", "-m", "deepspeed.launcher.launch",
                  f"--world_info={self.world_info_base64}", "--node_rank=%n",
                  f"--master_addr={self.args.master_addr}", f"--master_port={self.args.master_port}"]  # fmt: skip
        if self.args.venv_script is not None:
            launch.insert(0, f"source {self.args.venv_script};")
        launch += [flag for flag, on in (("--no_python", self.args.no_python), ("--module", self.args.module),
                                         ("--no_local_rank", self.args.no_local_rank)) if on]  # fmt: skip
        if self.args.save_pid:
            launch += ["--save_pid", str(os.getpid())]
        if self.args.enable_each_rank_log:
            launch.append(f"--enable_each_rank_log={self.args.enable_each_rank_log}")
        # the pattern pkill looks for: items 2-5 of the per-node command, as DeepSpeed takes them
        kill = pdsh + ["pkill -f ", " ".join(part + "\\" for part in launch[2:6])[:-2]]
        return pdsh + launch + [self.user_script] + self.user_arguments, kill, environment


class OpenMPIRunner(_MPIRunner):
    """``mpirun -n N -hostfile H`` (TCP transport: ``UCX_TLS=tcp``; ``btl_tcp_if_include eth0`` unless given)."""

    def __init__(self, args, world_info_base64, resource_pool):
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")

    def backend_exists(self):
        return shutil.which("ompi_info")

    @property
    def name(self) -> str:
        return "openmpi"

    def get_cmd(self, environment, active_resources):
        extra = split(self.args.launcher_args)
        chosen = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(extra, extra[1:]))
        mpirun = ["mpirun", "-n", str(sum(self.resource_pool.values())), "-hostfile", str(self.args.hostfile),
                  "--mca", "btl", "^openib", *([] if chosen else ["--mca", "btl_tcp_if_include", "eth0"]),
                  *extra]  # fmt: skip
        exports = [item for key, value in self.exports.items() for item in ("-x", f"{key}={value}")]
        return mpirun + exports + _python(self.args) + [self.user_script] + self.user_arguments


class MPICHRunner(_MPIRunner):
    """MPICH: detected and validated as DeepSpeed does, but :meth:`get_cmd` is refused (see there)."""

    def backend_exists(self):
        return shutil.which("mpirun")

    @property
    def name(self) -> str:
        return "mpich"

    def get_cmd(self, environment, active_resources):
        """Refused: the MPICH command runs a per-rank helper script of DeepSpeed's launcher that torsh does not ship,
        so no command built here could start. Start the job with ``torsh run`` (torchrun's options) or torchrun,
        or translate the deepspeed command with ``torsh-migrate launch ... --to torchrun``."""
        raise NotImplementedError("mpich backend: torsh's drop-in builds no MPICH command (it would run a per-rank "
                                  "launcher helper script torsh does not ship); start the job with `torsh run` "
                                  "(torchrun's options) or torchrun, or translate the deepspeed command with "
                                  "`torsh-migrate launch '<command>' --to torchrun`")  # fmt: skip


class IMPIRunner(_MPIRunner):
    """Intel MPI: ``mpirun -ppn P``, then one ``-n 1`` block per rank with its RANK and LOCAL_RANK."""

    def backend_exists(self):
        return shutil.which("mpirun")

    @property
    def name(self) -> str:
        return "impi"

    def validate_args(self) -> None:
        super().validate_args()
        if self.args.bind_cores_to_rank:
            raise ValueError("impi backend: --bind_cores_to_rank (numactl per rank) is not built by torsh's drop-in; "
                             "leave it out, or bind cores with Intel MPI's own I_MPI_PIN settings")  # fmt: skip

    def get_cmd(self, environment, active_resources):
        total, per_node = self._per_node("Intel MPI")
        mpirun = ["mpirun", "-ppn", str(per_node), *split(self.args.launcher_args)]
        exports = [item for key, value in self.exports.items() for item in ("-genv", key, value)]
        exports += self._rendezvous_env("-genv", total, per_node)
        exports += ["-genv", "I_MPI_PIN", "0", *self._hosts()]  # DeepSpeed does its own core binding
        per_rank: list[str] = []
        for rank in range(total):
            block = ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(rank % per_node),
                     *_python(self.args), self.user_script, *self.user_arguments]  # fmt: skip
            per_rank += block if rank == 0 else [":", *block]
        return mpirun + exports + per_rank


class SlurmRunner(_MPIRunner):
    """``srun -n N``: tasks by count on whole hosts (``--nodelist`` for an include/exclude filter)."""

    def backend_exists(self):
        return shutil.which("sinfo")

    @property
    def name(self) -> str:
        return "slurm"

    def validate_args(self) -> None:  # srun takes node and device counts, unlike the MPI back-ends
        MultiNodeRunner.validate_args(self)

    @classmethod
    def validate_active_resources(cls, active_resources) -> None:
        """srun cannot pin tasks to device ids, nor put a different number of tasks on each host."""
        for host, slots in active_resources.items():
            if list(slots) != list(range(len(slots))):
                raise ValueError(f"slurm backend cannot select specific device ids, got {list(slots)} on {host}. "
                                 "Filter whole hosts, or keep the first N slots on every host.")  # fmt: skip
        counts = {host: len(slots) for host, slots in active_resources.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"slurm backend needs the same slot count on every host, got {counts}.")

    def get_cmd(self, environment, active_resources):
        if getattr(self.args, "detect_nvlink_pairs", False):
            raise ValueError("slurm backend does not support remapping visible devices (detect_nvlink_pairs)")
        self.validate_active_resources(active_resources)
        total = sum(len(slots) for slots in active_resources.values())  # what the filters left
        srun = ["srun", "-n", str(total), *split(self.args.launcher_args)]
        if getattr(self.args, "slurm_comment", ""):
            srun += ["--comment", self.args.slurm_comment]
        if self.args.include != "" or self.args.exclude != "":
            srun += ["--nodelist", ",".join(active_resources.keys()), "--nodes", str(len(active_resources))]
        if self.args.num_nodes > 0:
            srun += ["--nodes", str(self.args.num_nodes)]
        if self.args.num_gpus > 0:
            srun += ["--gpus-per-node", str(self.args.num_gpus)]
        exports = "--export=ALL" + "".join(f",{key}={value}" for key, value in self.exports.items())
        return srun + [exports, sys.executable, "-u", self.user_script] + self.user_arguments


class MVAPICHRunner(_MPIRunner):
    """MVAPICH2-GDR's ``mpirun -np N -ppn P --hostfile H``, with MVAPICH's variables for deep-learning jobs.

    Building the command writes no file: ``H`` is :attr:`hostfile_path` (DeepSpeed's usual temporary hostfile
    path unless changed), and the caller writes :meth:`hostfile_lines` there before running the command."""

    hostfile_path = MVAPICH_TMP_HOSTFILE

    def __init__(self, args, world_info_base64, resource_pool):
        super().__init__(args, world_info_base64, resource_pool)
        from ..accelerator import get_accelerator

        for key, value in (("MV2_SMP_USE_CMA", "0"), ("MV2_DEBUG_SHOW_BACKTRACE", "1")):
            self.add_export(key, value)
        if get_accelerator().device_name() == "cuda":
            self.add_export("MV2_USE_CUDA", "1")
        for key, value in (("MV2_SUPPORT_DL", "1"), ("MV2_ENABLE_AFFINITY", "0"), ("MV2_INTER_ALLGATHER_TUNING", "5"),
                           ("MV2_CUDA_USE_NAIVE", "0")):  # fmt: skip
            self.add_export(key, value)

    def backend_exists(self):
        if not shutil.which("mpiname"):
            warnings.warn("mpiname does not exist, mvapich is not installed properly")
            return False
        found = subprocess.check_output(["mpiname"]).decode("utf-8").strip()
        if "MVAPICH2-GDR" not in found:
            warnings.warn(f"Expected MVAPICH2-GDR as return for mpiname but received {found}")
            return False
        return True

    @property
    def name(self) -> str:
        return "mvapich"

    def get_cmd(self, environment, active_resources):
        """The mpirun command naming :attr:`hostfile_path`; nothing is written (the caller writes the hostfile)."""
        total, per_node = self._per_node("mvapich")
        mpirun = ["mpirun", "-np", str(total), "-ppn", str(per_node), "--hostfile", self.hostfile_path,
                  *split(self.args.launcher_args)]  # fmt: skip
        exports = [item for key, value in self.exports.items() for item in ("-env", f"{key}={value}")]
        return mpirun + exports + _python(self.args) + [self.user_script] + self.user_arguments

    def hostfile_lines(self) -> list[str]:
        """The hostfile the command expects at :attr:`hostfile_path`: one host per line, in resource-pool order."""
        return [f"{host}\n" for host in self.resource_pool]
