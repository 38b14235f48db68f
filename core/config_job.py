"""The sections of the config model that decide how the job runs around the training step: communication, the
launch (nodes, processes, rendezvous, environment), checkpoints, monitoring, the parallel degrees, the pipeline
schedule and the dataloader. Imported from :mod:`torsh.config`."""

# No ``from __future__ import annotations`` in this module: with it, pydantic compiles and evaluates the field
# annotations from strings when the classes are built (~4 ms of every torsh-migrate call); as real objects they
# come from the module's cached bytecode. Annotations naming their own class are quoted.

from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator
from typing_extensions import TypeAliasType

from . import _config_docs
from .config_base import MAX_BYTES_SIZE, MAX_PROCESSES, MAX_PROCESSES_PER_NODE, MAX_TIMEOUT_S, MaybeAuto, Section

_DOCSTRING_READER = _config_docs.install(__name__, __file__)


# --------------------------------------------------------------------------------------------------
# communication, launch


class CommunicationConfig(Section):
    """The process group and collective settings."""

    backend: Literal["auto", "nccl", "gloo", "mpi", "ccl"] = "auto"
    """torch.distributed backend. auto: nccl with CUDA, gloo otherwise."""
    init_method: str | None = None
    """Process-group init method (``env://``, ``tcp://host:port``, ``file://...``). None: ``env://``."""
    timeout_s: Annotated[float, Field(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    """Collective timeout in seconds. None: torch's default."""
    hierarchical_allreduce: bool = False
    """Reduce within nodes, then across nodes (Horovod)."""
    hierarchical_allgather: bool = False
    """Gather within nodes, then across nodes (Horovod)."""
    fusion_threshold_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES_SIZE)] | None = None
    """Tensor-fusion buffer size in bytes (Horovod); 0 disables fusion."""
    cycle_time_ms: Annotated[float, Field(ge=0.0, le=MAX_TIMEOUT_S * 1000)] | None = None
    """Fusion cycle time in milliseconds (Horovod)."""


ProcessCount = Annotated[int, Field(gt=0, le=MAX_PROCESSES)]
"""A number of processes or nodes: at least 1, at most :data:`MAX_PROCESSES`."""
PerNodeCount = Annotated[int, Field(gt=0, le=MAX_PROCESSES_PER_NODE)]
"""Processes on one node: at least 1, at most :data:`MAX_PROCESSES_PER_NODE`."""


class Host(Section):
    """One machine of a multi-node job."""

    name: str
    """Host name or address."""
    slots: PerNodeCount | None = None
    """Processes (usually accelerators) on this host. None: the launcher decides."""


# A named alias: pydantic builds one validator for it per model and refers to it from each of the seven launch fields
# that accept it. Inlined, its Unicode pattern was compiled fourteen times (in LaunchConfig's and TorshConfig's
# validators): ~6 ms of this module's import and ~1.7 MiB of memory. The JSON schema names it once, $defs/ShellRef.
ShellRef = TypeAliasType(
    "ShellRef", Annotated[str, Field(pattern=r"^(\$\w+|\$\{[^{}]+\}|\$\(\([^()]*\)\)|<[^<>]+>|\{\w+\})$")])
"""A launch value written as a shell variable (``$NGPU``, ``${NODE_RANK:-0}``, ``$((N * 8))``) or a documentation
placeholder (``<n>``, ``{num_gpus}``); kept verbatim for the shell that runs the command."""


class LaunchConfig(Section):
    """How the processes of the job are started (torchrun, deepspeed, horovodrun, mpirun)."""

    nnodes: ProcessCount | ShellRef | None = None
    """Number of nodes (the minimum when elastic)."""
    max_nnodes: ProcessCount | ShellRef | None = None
    """Maximum number of nodes for an elastic job. None: fixed size."""
    nproc_per_node: PerNodeCount | Literal["auto", "gpu", "cpu"] | ShellRef | None = None
    """Processes per node."""
    world_size: ProcessCount | ShellRef | None = None
    """Total processes, when given without a topology (e.g. ``horovodrun -np``)."""
    node_rank: Annotated[int, Field(ge=0, lt=MAX_PROCESSES)] | ShellRef | None = None
    """This node's index (static rendezvous)."""
    master_addr: str | None = None
    """Address of rank 0 (static rendezvous)."""
    master_port: Annotated[int, Field(ge=0, le=65535)] | ShellRef | None = None
    """Port of rank 0 (static rendezvous)."""
    rdzv_backend: str | None = None
    """Rendezvous backend (static, c10d, etcd, ...)."""
    rdzv_endpoint: str | None = None
    """Rendezvous host[:port]."""
    rdzv_id: str | None = None
    """Rendezvous job id."""
    rdzv_conf: dict[str, str] = {}
    """Extra rendezvous settings (``timeout``, ``join_timeout``, ...)."""
    standalone: bool = False
    """Single-node job with a local rendezvous."""
    max_restarts: NonNegativeInt | ShellRef | None = None
    """Worker-group restarts before failing."""
    hosts: list[Host] = []
    """Hosts and their slots (hostfile / ``-H``)."""
    hostfile: str | None = None
    """Path of the hostfile the command names (its hosts, when known, are in ``hosts``)."""
    include: str | None = None
    """DeepSpeed ``--include`` node/slot filter."""
    exclude: str | None = None
    """DeepSpeed ``--exclude`` node/slot filter."""
    script: str | None = None
    """Training script (or module with ``module``)."""
    script_args: list[str] = []
    """Arguments passed to the training script."""
    module: bool = False
    """Run ``script`` as a module (``python -m``)."""
    no_python: bool = False
    """Execute ``script`` directly, not through Python."""
    local_rank_argv: Literal["--local_rank", "--local-rank"] | None = None
    """The flag the launcher appends to the script's arguments with the local rank (deepspeed: ``--local_rank``,
    ``torch.distributed.launch``: ``--local-rank``). None: the script gets only the ``LOCAL_RANK`` variable."""
    env: dict[str, str] = {}
    """Environment variables exported to every worker."""
    forward_env: list[str] = []
    """Variables forwarded to every worker with their value in the launching shell (``mpirun -x NAME``)."""

    @model_validator(mode="after")
    def _elastic_range(self) -> "LaunchConfig":
        if isinstance(self.max_nnodes, int) and isinstance(self.nnodes, int) and self.max_nnodes < self.nnodes:
            raise ValueError(f"launch.max_nnodes ({self.max_nnodes}) is smaller than launch.nnodes ({self.nnodes})")
        if self.include and self.exclude:
            raise ValueError("launch.include and launch.exclude cannot both be set (DeepSpeed rejects it too)")
        return self


# --------------------------------------------------------------------------------------------------
# checkpoint, monitoring, pipeline, data


class CheckpointConfig(Section):
    """Where and how often checkpoints are written."""

    dir: str | None = None
    """Checkpoint directory."""
    interval_steps: PositiveInt | None = None
    """Save every N optimizer steps. None: only when the script asks."""
    keep_last: PositiveInt | None = None
    """Keep only the newest N checkpoints. None: keep all."""
    tag_validation: Literal["warn", "ignore", "fail"] = "warn"
    """Check that every rank saves under the same tag."""
    save_full_weights: bool = False
    """Also save consolidated (unsharded) weights in the compute dtype (DeepSpeed
    ``gather_16bit_weights_on_model_save``)."""
    state_dict_type: Literal["sharded", "full"] = "sharded"
    """Checkpoint form: one shard per rank, or one full state dict."""


class WriterConfig(Section):
    """A metrics writer (TensorBoard, CSV)."""

    enabled: bool = False
    """Write metrics."""
    output_path: str = ""
    """Directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory per run."""


class WandbConfig(Section):
    """Weights & Biases logging."""

    enabled: bool = False
    """Log to wandb."""
    project: str | None = None
    """Project name."""
    team: str | None = None
    """Team (entity)."""
    group: str | None = None
    """Run group."""


class ProfilerConfig(Section):
    """FLOPs / time profiling at one step."""

    enabled: bool = False
    """Profile."""
    profile_step: PositiveInt = 1
    """Step to profile."""
    module_depth: int = Field(default=-1, ge=-1)
    """Depth of the module tree in the report (-1: all)."""
    top_modules: NonNegativeInt = 1
    """Modules listed per level."""
    detailed: bool = True
    """Per-module detail."""
    output_file: str | None = None
    """Report file. None: stdout."""


class TimelineConfig(Section):
    """A communication timeline trace (Horovod timeline)."""

    filename: str | None = None
    """Trace file."""
    mark_cycles: bool = False
    """Mark fusion cycles in the trace."""


class MonitoringConfig(Section):
    """Logging, metrics and profiling."""

    steps_per_print: PositiveInt | None = None
    """Log progress every N optimizer steps. None: never."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately."""
    log_level: str | None = None
    """Log level of the framework's logger."""
    tensorboard: WriterConfig = WriterConfig()
    """TensorBoard events."""
    csv: WriterConfig = WriterConfig()
    """CSV metrics files."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases."""
    profiler: ProfilerConfig = ProfilerConfig()
    """FLOPs profiler."""
    timeline: TimelineConfig = TimelineConfig()
    """Communication timeline."""


class ParallelismConfig(Section):
    """The parallel degrees of the job's device mesh, named as torchtitan and Accelerate name them.

    The data-parallel degree is what the others leave: world size / (tp x pp x cp x sp). Within it, the shard group
    is ``sharding.hybrid_shard_size`` (the dp_shard degree; None: every data-parallel rank) and ``dp_replicate`` the
    number of groups; give one of the two, the other follows from the world size.
    """

    dp_replicate: PositiveInt | None = None
    """Data-parallel replicas of the shard groups (HSDP). None: the data-parallel ranks / sharding.hybrid_shard_size;
    set it instead of sharding.hybrid_shard_size when the group size depends on the world size."""
    tp: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] = 1
    """Tensor-parallel degree: the model's linear layers are split over this many ranks (DTensor)."""
    pp: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] | MaybeAuto = 1
    """Pipeline-parallel degree (pipeline stages). "auto": the stages of a DeepSpeed ``PipelineModule``."""
    cp: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] = 1
    """Context-parallel degree: each sequence split over this many ranks, attention over the whole of it (inside
    ``engine.context_parallel(buffers=...)``, as torch's ``context_parallel`` and Accelerate's ``cp_size``)."""
    sp: Annotated[int, Field(gt=0, le=MAX_PROCESSES)] = 1
    """Sequence-parallel degree (DeepSpeed-Ulysses, DeepSpeed's ``sequence_parallel_size``): each sequence is split
    over this many consecutive ranks, whose ``DistributedAttention`` exchanges heads for sequence; gradients are
    summed over them and averaged over the world size / sp data-parallel replicas, as DeepSpeed reduces them."""
    tp_plan: dict[str, Literal["colwise", "rowwise"]] | None = None
    """Which linear layers tensor parallelism splits: module-name patterns (``*`` matches within one dotted name,
    ``**`` across them) -> colwise or rowwise. None: the default plan for Hugging Face-style names."""


class PipelineConfig(Section):
    """Pipeline schedule settings (the number of stages is ``parallelism.pp``)."""

    micro_batches: PositiveInt | None = None
    """Micro-batches per pipeline step."""
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] | None = None
    """Schedule."""
    partition_method: str | None = None
    """How layers are assigned to stages (DeepSpeed ``partition``: parameters, uniform, type:...)."""
    activation_checkpoint_interval: NonNegativeInt = 0
    """Checkpoint every N layers (0: off)."""

    @model_validator(mode="before")
    @classmethod
    def _stages_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stages" in data:
            raise ValueError(f"pipeline.stages={data['stages']!r} moved to parallelism.pp (one place for every "
                             "parallel degree): write it there")  # fmt: skip
        return data


class DataConfig(Section):
    """The training dataloader ``torsh.initialize`` builds from ``training_data``."""

    drop_last: bool = False
    """Drop the last incomplete batch (DeepSpeed ``dataloader_drop_last``)."""
    shuffle: bool = True
    """Shuffle with a ``DistributedSampler``."""
    seed: int = Field(default=0, ge=-(2**63), lt=2**64)
    """Sampler seed."""
    num_workers: Annotated[int, Field(ge=0, le=MAX_PROCESSES_PER_NODE)] = 0
    """Dataloader worker processes."""
    epochs: PositiveInt | None = None
    """Passes over the data (used to resolve "auto" total step counts)."""


_config_docs.restore(_DOCSTRING_READER)  # every model class of this module is built
