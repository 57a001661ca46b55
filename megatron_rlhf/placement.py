"""Cluster placement: which SLURM nodes learn, which generate, and how the job is submitted.

The YAML section ``placement`` (read by ``slurm/submit.py`` and ``slurm/ray_cluster.sh``; ignored by
a local run, which starts its own Ray)::

    placement:
      learner_nodes: 1        # nodes whose GPUs hold the Megatron learner group (TP x PP x DP ranks)
      generator_nodes: 1      # nodes whose GPUs hold the vLLM engines
      gpus_per_node: 8
      time_limit: "24:00:00"
      signal_lead_s: 300      # SIGTERM this long before the time limit: checkpoint, then requeue

Learners and vLLM engines never share a GPU: on GPU nodes the two node sets are disjoint, and
``slurm/ray_cluster.sh`` gives learner nodes the Ray resource ``mrlhf_learner`` and generator nodes
``mrlhf_generator`` (one unit per GPU), so an actor that asks for one unit lands on its own side.
A CPU-only job (``gpus_per_node: 0``) may run both roles on one node (``share_nodes: true``).

:func:`check_layout` is the cross-section check (learner world size == learner GPUs, engines fit
the generator GPUs) that ``Config.__post_init__`` runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["PlacementConfig", "check_layout"]

_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


def _fail(key: str, value, allowed: str) -> None:
    from megatron_rlhf.config import ConfigError

    raise ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")


@dataclass(kw_only=True)
class PlacementConfig:
    """Where the run's processes go on a SLURM cluster, and the job's SLURM options.

    Raises:
        ConfigError: a count below its minimum, both roles on one GPU node, a malformed
            ``time_limit``, a ``signal_lead_s`` outside [30, 3600], a reserved sbatch option in
            ``extra_sbatch``.
    """

    learner_nodes: int = 1
    """Nodes for the learner group; all their GPUs are learner ranks (TP x PP x DP of them)."""
    generator_nodes: int = 1
    """Nodes for the vLLM engines (``generators.num_workers`` engines of
    ``generators.tensor_parallel`` GPUs each)."""
    gpus_per_node: int = 0
    """GPUs per node, requested with ``--gpus-per-node`` and declared to Ray; 0 = CPU-only nodes
    (the default, so that a local config without a ``placement`` section passes every check)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (GiB, e.g. 80 for H100 80GB, 141 for H200): the budget
    ``tools/plan_memory.py`` checks the layout against before submission."""
    cpus_per_node: int = 0
    """CPUs per node requested (``--cpus-per-task``, one task per node) and declared to Ray;
    0 = the whole node (``--exclusive``)."""
    share_nodes: bool = False
    """CPU only: learners and generators on the same node(s); then ``learner_nodes`` must equal
    ``generator_nodes`` and the job has that many nodes."""
    partition: str = ""
    """SLURM partition (``--partition``); empty = the cluster's default."""
    account: str = ""
    """SLURM account (``--account``); empty = the user's default."""
    time_limit: str = "24:00:00"
    """``--time`` as SLURM writes it: ``[D-]HH[:MM[:SS]]``."""
    signal_lead_s: int = 300
    """``--signal=B:TERM@<s>``: SIGTERM to the batch shell this many seconds before the time limit,
    enough to finish a step and write a checkpoint (SLURM may send it up to 60 s early)."""
    network_interface: str = ""
    """NCCL/gloo network interface (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``), e.g. ``ib0``
    or ``eth0``, or ``auto``: the interface holding the batch node's address (``hostname -I``,
    resolved by ``slurm/ray_cluster.sh``; the same name is used on every node). Required for GPU
    jobs (always multi-node): gloo groups (megatron creates them beside NCCL's) would otherwise
    bind loopback and hang across nodes. The environment variable wins when set."""
    dist_timeout_s: int = 1800
    """torch.distributed collective timeout the learners use (exported as MRLHF_DIST_TIMEOUT_S)."""
    ray_port: int = 6379
    """GCS port of the Ray head."""
    ray_join_timeout_s: int = 300
    """Seconds to wait for every node's Ray worker to join before giving up."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Further ``#SBATCH`` options, each a full flag, e.g. ``["--qos=high", "--mem=0"]``."""

    def __post_init__(self):
        if self.learner_nodes < 1:
            _fail("placement.learner_nodes", self.learner_nodes, "an integer >= 1")
        if self.generator_nodes < 1:
            _fail("placement.generator_nodes", self.generator_nodes, "an integer >= 1")
        if self.gpus_per_node < 0:
            _fail("placement.gpus_per_node", self.gpus_per_node, "an integer >= 0 (0 = CPU nodes)")
        if self.gpu_memory_gib <= 0:
            _fail("placement.gpu_memory_gib", self.gpu_memory_gib, "a number of GiB > 0")
        if self.cpus_per_node < 0:
            _fail("placement.cpus_per_node", self.cpus_per_node, "an integer >= 0 (0 = whole node)")
        if self.share_nodes and self.gpus_per_node > 0:
            _fail("placement.share_nodes", self.share_nodes,
                  "false on GPU nodes: learners and vLLM engines must not share GPUs "
                  "(set placement.gpus_per_node: 0 for a CPU-only job)")
        if self.share_nodes and self.learner_nodes != self.generator_nodes:
            _fail("placement.generator_nodes", self.generator_nodes,
                  f"equal to placement.learner_nodes ({self.learner_nodes}) when share_nodes is true")
        if not _TIME_RE.match(self.time_limit):
            _fail("placement.time_limit", self.time_limit, "SLURM time like '24:00:00' or '2-00:00:00'")
        if not 30 <= self.signal_lead_s <= 3600:
            _fail("placement.signal_lead_s", self.signal_lead_s,
                  "seconds in [30, 3600] (time to checkpoint before the time limit)")
        if self.dist_timeout_s < 60:
            _fail("placement.dist_timeout_s", self.dist_timeout_s, "seconds >= 60")
        if not 1024 <= self.ray_port <= 65535:
            _fail("placement.ray_port", self.ray_port, "a port in [1024, 65535]")
        if self.ray_join_timeout_s < 10:
            _fail("placement.ray_join_timeout_s", self.ray_join_timeout_s, "seconds >= 10")
        reserved = ("--nodes", "-N", "--signal", "--requeue", "--open-mode", "--gpus-per-node",
                    "--ntasks-per-node", "--cpus-per-task", "--time", "--job-name", "--output")
        for opt in self.extra_sbatch:
            if not opt.startswith("-"):
                _fail("placement.extra_sbatch", opt, "full sbatch flags like '--qos=high'")
            if opt.split("=")[0] in reserved:
                _fail("placement.extra_sbatch", opt,
                      f"not one of {', '.join(reserved)}: those come from the other placement keys")

    @property
    def num_nodes(self) -> int:
        """Nodes the job allocates: learner + generator nodes, or one set when ``share_nodes``."""
        return self.learner_nodes if self.share_nodes else self.learner_nodes + self.generator_nodes

    @property
    def learner_gpus(self) -> int:
        """GPUs available to the learner group (0 on CPU nodes)."""
        return self.learner_nodes * self.gpus_per_node

    @property
    def generator_gpus(self) -> int:
        """GPUs available to the vLLM engines (0 on CPU nodes)."""
        return self.generator_nodes * self.gpus_per_node


def check_layout(placement: PlacementConfig, *, learner_world_size: int,
                 learner_tensor_parallel: int, num_engines: int, engine_tensor_parallel: int,
                 reward_models: int = 0) -> None:
    """Check that the parallel layout fills the placement exactly (GPU jobs only).

    Args:
        placement: the ``placement`` section.
        learner_world_size: ``learner.tensor_parallel * pipeline_parallel * data_parallel``.
        learner_tensor_parallel: ``learner.tensor_parallel`` (a TP group must fit in one node).
        num_engines: ``generators.num_workers``.
        engine_tensor_parallel: GPUs per vLLM engine (``generators.tensor_parallel``).
        reward_models: reward-model actors (distinct ``tasks[].reward.reward_model`` folders); each
            takes one GPU of the generator nodes.
    Raises:
        ConfigError: a multi-node GPU job without ``placement.network_interface``, learner ranks != learner GPUs (an idle or missing GPU is a config mistake),
            or the engines need more GPUs than the generator nodes have, or a learner or engine
            TP group would span nodes (TP traffic needs NVLink). No check on CPU nodes (``gpus_per_node == 0``),
            where ranks are processes.
    """
    g = placement.gpus_per_node
    if g == 0:
        return
    if not placement.network_interface and placement.num_nodes > 1:
        _fail("placement.network_interface", placement.network_interface,
              f"set for a {placement.num_nodes}-node job: the interface the nodes reach each other "
              "on (e.g. ib0, eth0), or auto (the interface of the batch node's address); "
              "without it gloo groups default to loopback and hang across nodes")
    if learner_world_size != placement.learner_gpus:
        _fail("learner.tensor_parallel*pipeline_parallel*data_parallel", learner_world_size,
              f"equal to the learner GPUs, placement.learner_nodes ({placement.learner_nodes}) x "
              f"placement.gpus_per_node ({g}) = {placement.learner_gpus}")
    if learner_tensor_parallel > g or g % learner_tensor_parallel:
        _fail("learner.tensor_parallel", learner_tensor_parallel,
              f"a divisor of placement.gpus_per_node ({g}): a TP group must not span nodes")
    if engine_tensor_parallel > g or g % engine_tensor_parallel:
        _fail("generators.tensor_parallel", engine_tensor_parallel,
              f"a divisor of placement.gpus_per_node ({g}): an engine must not span nodes")
    need = num_engines * engine_tensor_parallel + reward_models
    if need > placement.generator_gpus:
        _fail("generators.num_workers", num_engines,
              f"at most {(placement.generator_gpus - reward_models) // engine_tensor_parallel} engines of "
              f"{engine_tensor_parallel} GPUs on placement.generator_nodes "
              f"({placement.generator_nodes}) x {g} GPUs"
              + (f" with {reward_models} reward-model GPU(s) beside them" if reward_models else ""))
