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

At run time on a GPU cluster (``gpus_per_node > 0`` and GPUs in the Ray cluster) :class:`ActorPlacement`
reserves Ray placement groups before any actor starts: the learner ranks in one bundle per node
(rank r on node ``r // gpus_per_node``, so every TP group, made of consecutive ranks, stays inside a
node), each vLLM engine's GPUs in one bundle (one node), each reward model on a generator node.
:func:`check_cluster_fits` first assigns the bundles on paper against the live nodes and names the
shortfall when the cluster cannot hold the layout (a node that did not join, fewer GPUs than
``placement`` says).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_rlhf.errors import ConfigError

__all__ = ["PlacementConfig", "check_layout", "BundleLayout", "check_cluster_fits", "ActorPlacement"]

_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


def _fail(key: str, value, allowed: str) -> None:
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


# ----------------------------------------------------------------------------------- Ray placement
@dataclass(frozen=True)
class BundleLayout:
    """GPU bundles a GPU run asks Ray for.

    Attributes:
        gpus_per_node: ``placement.gpus_per_node`` (g).
        learner: GPUs of each learner bundle, one bundle per node: ``[g, g, ..., rest]``; learner
            rank r goes to bundle ``r // g``, so each TP group (consecutive ranks, g % TP == 0)
            stays inside one node.
        engines: GPUs of each vLLM engine's bundle (``generators.tensor_parallel``; one node each).
        reward_models: reward-model actors, one GPU each, on a generator node.
    """

    gpus_per_node: int
    learner: tuple[int, ...]
    engines: tuple[int, ...]
    reward_models: int = 0

    @classmethod
    def from_config(cls, cfg, reward_models: int = 0) -> "BundleLayout":
        """From a loaded ``Config`` (``learner.*``, ``generators.*``, ``placement.gpus_per_node``)."""
        g, lc = cfg.placement.gpus_per_node, cfg.learner
        world = lc.tensor_parallel * lc.pipeline_parallel * lc.data_parallel
        learner = tuple(min(g, world - i * g) for i in range(-(-world // g)))
        return cls(gpus_per_node=g, learner=learner,
                   engines=(cfg.generators.tensor_parallel,) * cfg.generators.num_workers,
                   reward_models=reward_models)

    def learner_bundle(self, rank: int) -> int:
        """Bundle (= node) of learner rank ``rank``."""
        return rank // self.gpus_per_node


def _gpus(node: dict, role: str | None) -> int:
    """GPUs of a node usable by ``role`` (its ``mrlhf_<role>`` amount when the cluster declares
    role resources)."""
    gpus = int(node.get("GPU", 0))
    return min(gpus, int(node.get(f"mrlhf_{role}", 0))) if role else gpus


def check_cluster_fits(layout: BundleLayout, nodes: list[dict], *, role_resources: bool) -> dict:
    """Assign every bundle to a node on paper (before any actor), or say what is short.

    Args:
        layout: the bundles.
        nodes: total resources of each alive Ray node (``ray.nodes()[i]["Resources"]``).
        role_resources: the cluster declares ``mrlhf_learner`` / ``mrlhf_generator``
            (slurm/ray_cluster.sh): learner bundles only on learner nodes, the rest on generator nodes.
    Returns:
        ``{"learner": [node index per learner bundle], "engines": [...], "reward_models": [...]}``.
    Raises:
        ConfigError: the learner group needs more nodes with g GPUs than the cluster has, or the
            engines and reward models do not fit the generator nodes' GPUs; the message names the
            shortfall, the cluster's GPUs per node and the keys to change.
    """
    free = [_gpus(n, "learner" if role_resources else None) for n in nodes]
    order = sorted(range(len(nodes)), key=lambda i: -free[i])
    learner = []
    for b, size in enumerate(layout.learner):   # one node per bundle (STRICT_SPREAD)
        if b >= len(order) or free[order[b]] < size:
            have = sum(1 for f in free if f >= layout.learner[0])
            raise ConfigError(
                f"placement: the learner group ({sum(layout.learner)} ranks) needs {len(layout.learner)} "
                f"node(s) with {layout.learner[0]} GPUs each" + (" and the mrlhf_learner resource" if role_resources else "")
                + f" (rank r on node r // placement.gpus_per_node={layout.gpus_per_node}); the Ray cluster has "
                f"{have}: short by {len(layout.learner) - have} node(s) (learner GPUs per node: {sorted(free, reverse=True)}). "
                "Allocate more learner nodes (placement.learner_nodes) or lower learner.tensor_parallel * "
                "pipeline_parallel * data_parallel")
        learner.append(order[b])
    gen_free = [_gpus(n, "generator") if role_resources else _gpus(n, None) for n in nodes]
    if not role_resources:
        for i, size in zip(learner, layout.learner):
            gen_free[i] -= size
    cap = list(gen_free)
    placed: dict[str, list[int]] = {"engines": [], "reward_models": []}
    items = [("engines", s) for s in layout.engines] + [("reward_models", 1)] * layout.reward_models
    for kind, size in items:   # engines first (largest), then reward models: first fit
        node = next((i for i in sorted(range(len(cap)), key=lambda i: -cap[i]) if cap[i] >= size), None)
        if node is None:
            need = sum(layout.engines) + layout.reward_models
            fit = len(placed["engines"])
            raise ConfigError(
                f"placement: {len(layout.engines)} vLLM engine(s) of generators.tensor_parallel="
                f"{layout.engines[0] if layout.engines else 0} GPUs (each on one node)"
                + (f" + {layout.reward_models} reward-model GPU(s)" if layout.reward_models else "")
                + f" need {need} GPUs on generator nodes; the Ray cluster's generator nodes have "
                f"{[g for g in gen_free if g > 0] or 'none'} GPUs: only {fit} engine(s) fit, short by "
                f"{need - sum(max(g, 0) for g in gen_free)} GPU(s) or a node with {size} free GPUs. Allocate more "
                "generator nodes (placement.generator_nodes) or lower generators.num_workers")
        cap[node] -= size
        placed[kind].append(node)
    return {"learner": learner, **placed}


class ActorPlacement:
    """Ray placement groups of one GPU run: learner bundles per node, one bundle per engine, one per
    reward model; actors are scheduled into them with :meth:`learner_options` etc.

    Learner: one placement group, one bundle of ``g`` GPUs (and g CPUs) per node, strategy
    ``STRICT_SPREAD`` (distinct nodes); rank r uses bundle ``r // g``. Engine i: its own group of one
    bundle ``{GPU: tensor_parallel, CPU: 1}`` (a bundle never spans nodes, so all TP workers of
    the engine share the node; the ``mp`` executor starts them there). Reward model j: a bundle
    ``{GPU: 1, CPU: 1}`` on a generator node. With role resources (slurm/ray_cluster.sh) each
    bundle also asks for ``mrlhf_learner`` / ``mrlhf_generator``.

    Args:
        layout: the bundles (:meth:`BundleLayout.from_config`).
        timeout_s: how long to wait for Ray to reserve every bundle.
    Raises:
        ConfigError: :func:`check_cluster_fits` finds a shortfall, or Ray cannot reserve the groups
            within ``timeout_s`` (the groups are removed again); no actor has started.

    Source: Ray docs "Placement Groups" (``placement_group``, ``STRICT_SPREAD``/``STRICT_PACK``,
    ``PlacementGroupSchedulingStrategy``).
    """

    def __init__(self, layout: BundleLayout, timeout_s: float = 300.0, engine_backend: str = "mp"):
        import ray
        from ray.util.placement_group import placement_group

        self.layout, self.engine_backend = layout, engine_backend
        self.learner_pg, self.engine_pgs, self.reward_pgs = None, [], []
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        self.role_resources = any("mrlhf_learner" in n for n in nodes)
        self.assignment = check_cluster_fits(layout, nodes, role_resources=self.role_resources)

        def bundle(gpus: int, cpus: int, role: str) -> dict:
            b = {"GPU": float(gpus), "CPU": float(cpus)}
            if self.role_resources:
                b[f"mrlhf_{role}"] = float(gpus)
            return b

        self.learner_pg = placement_group([bundle(s, s, "learner") for s in layout.learner],
                                          strategy="STRICT_SPREAD" if len(layout.learner) > 1 else "STRICT_PACK",
                                          name="mrlhf-learner")
        for i, tp in enumerate(layout.engines):
            # mp: one bundle holds all TP GPUs, visible to the engine actor, which starts its workers;
            # ray (TP > 1): one GPU bundle per worker, packed on one node; vLLM's Ray executor places
            # its workers into the engine actor's (captured) group
            shape = [bundle(tp, 1, "generator")] if engine_backend == "mp" or tp == 1 else \
                [bundle(1, 1, "generator") for _ in range(tp)]
            self.engine_pgs.append(placement_group(shape, strategy="STRICT_PACK", name=f"mrlhf-engine-{i}"))
        self.reward_pgs = [placement_group([bundle(1, 1, "generator")], strategy="STRICT_PACK",
                                           name=f"mrlhf-reward-{j}") for j in range(layout.reward_models)]
        groups = [self.learner_pg, *self.engine_pgs, *self.reward_pgs]
        ready, _ = ray.wait([pg.ready() for pg in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            self.remove()
            raise ConfigError(f"placement: Ray reserved only {len(ready)} of {len(groups)} placement groups "
                              f"within {timeout_s:.0f} s (learner bundles {list(layout.learner)}, engines "
                              f"{list(layout.engines)}, reward models {layout.reward_models}); cluster "
                              f"resources now: {ray.available_resources()}")

    @staticmethod
    def _strategy(pg, index: int = 0, capture: bool = False):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=capture)

    def learner_options(self, rank: int) -> dict:
        """Ray options of learner rank ``rank``: one GPU and one CPU of bundle ``rank // g``."""
        return {"num_cpus": 1, "num_gpus": 1,
                "scheduling_strategy": self._strategy(self.learner_pg, self.layout.learner_bundle(rank))}

    def engine_options(self, i: int) -> dict:
        """Ray options of engine ``i``: ``mp`` backend (or TP 1): its bundle's GPUs (all on one node)
        and one CPU; ``ray`` backend: no resources of its own, in bundle 0 of its group, whose
        bundles vLLM's Ray workers take (not verified on GPUs here)."""
        tp = self.layout.engines[i]
        if self.engine_backend == "mp" or tp == 1:
            return {"num_cpus": 1, "num_gpus": tp, "scheduling_strategy": self._strategy(self.engine_pgs[i])}
        return {"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": self._strategy(self.engine_pgs[i], capture=True)}

    def reward_options(self, j: int) -> dict:
        """Ray options of reward model ``j``: one GPU on a generator node."""
        return {"num_cpus": 1, "num_gpus": 1, "scheduling_strategy": self._strategy(self.reward_pgs[j])}

    def remove(self) -> None:
        """Release every placement group (end of run)."""
        from ray.util.placement_group import remove_placement_group

        for pg in [self.learner_pg, *self.engine_pgs, *self.reward_pgs]:
            if pg is None:
                continue
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone
                pass
