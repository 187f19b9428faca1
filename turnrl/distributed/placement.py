"""Where the actors go: Ray started (or joined), one placement group, a bundle per actor or per GPU.

- `split`: engine replicas get `tensor_parallel_size` GPUs each, training ranks one GPU each, none shared. By
  default half the GPUs (rounded to whole replicas) serve and the rest train.
- `colocated`: one bundle per GPU holds a training rank and an engine replica (half a GPU each in Ray's
  accounting; in fact they take turns: the engine sleeps while the trainer updates). One replica per GPU, so
  `tensor_parallel_size` must be 1.
- Without GPUs (`gpus_per_node=0`, or a cluster that has none) every actor gets `cpus_per_actor` CPUs and the
  ranks talk over gloo; `colocated` then puts replica i in rank i's bundle.

The placement group uses Ray's PACK strategy: bundles fill one node before the next, so a replica's GPUs (one
bundle) are always on one node and training ranks sit together where they fit. A group that cannot be placed
(too few GPUs or nodes) fails after `timeout_s` with the numbers it asked for, instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Layout:
    mode: str                      # colocated | split
    ranks: int
    replicas: int
    tp: int                        # GPUs per replica (split), 0 on CPU
    gpu: bool
    bundles: list[dict[str, float]] = field(default_factory=list)
    rank_bundle: list[int] = field(default_factory=list)
    replica_bundle: list[int] = field(default_factory=list)
    rank_resources: dict[str, float] = field(default_factory=dict)     # num_gpus / num_cpus of a rank actor
    replica_resources: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        where = "GPU" if self.gpu else "CPU"
        return (f"{self.mode}: {self.ranks} training rank(s), {self.replicas} engine replica(s)"
                f"{f' x {self.tp} GPU(s)' if self.gpu and self.mode == 'split' else ''} on {where}")


def plan_layout(mode: str, nodes: int, gpus_per_node: int, ranks: int, replicas: int, tp: int,
                cpus: float) -> Layout:
    """The bundles and who sits in which; `ranks`/`replicas` 0 mean 'derive them'."""
    if mode not in ("colocated", "split"):
        raise ValueError(f"placement must be colocated or split, got {mode!r}")
    gpus = nodes * gpus_per_node
    if gpus == 0:
        ranks = ranks or 1
        replicas = replicas or (ranks if mode == "colocated" else 1)
        if mode == "colocated":
            if replicas != ranks:
                raise ValueError(f"colocated placement puts one engine replica beside each training rank: set "
                                 f"engine.replicas={ranks} (or 0), got {replicas}")
            bundles = [{"CPU": 2 * cpus} for _ in range(ranks)]
            return Layout(mode, ranks, replicas, 0, False, bundles, list(range(ranks)), list(range(ranks)),
                          {"num_cpus": cpus}, {"num_cpus": cpus})
        bundles = [{"CPU": cpus} for _ in range(replicas + ranks)]
        return Layout(mode, ranks, replicas, 0, False, bundles, list(range(replicas, replicas + ranks)),
                      list(range(replicas)), {"num_cpus": cpus}, {"num_cpus": cpus})
    if mode == "colocated":
        if tp != 1:
            raise ValueError("colocated placement runs one engine replica per GPU: set engine.tensor_parallel_size=1, "
                             "or use trainer.placement=split for tensor-parallel engines")
        ranks, replicas = ranks or gpus, replicas or gpus
        if ranks != gpus or replicas != gpus:
            raise ValueError(f"colocated placement uses every GPU for both training and serving: {gpus} GPU(s) "
                             f"({nodes} node(s) x {gpus_per_node}) means trainer.ranks={gpus} and "
                             f"engine.replicas={gpus} (or 0 for both), got {ranks} and {replicas}")
        bundles = [{"GPU": 1.0, "CPU": 2 * cpus} for _ in range(gpus)]
        return Layout(mode, ranks, replicas, 1, True, bundles, list(range(gpus)), list(range(gpus)),
                      {"num_gpus": 0.5, "num_cpus": cpus}, {"num_gpus": 0.5, "num_cpus": cpus})
    if replicas == 0:
        replicas = max(1, (gpus - ranks) // tp if ranks else gpus // 2 // tp)
    if ranks == 0:
        ranks = gpus - replicas * tp
    if ranks < 1 or replicas * tp + ranks > gpus:
        raise ValueError(f"split placement needs engine.replicas x tensor_parallel_size + trainer.ranks <= GPUs: "
                         f"{replicas} x {tp} + {ranks} > {gpus} ({nodes} node(s) x {gpus_per_node} GPU(s))")
    if tp > gpus_per_node:
        raise ValueError(f"a replica's {tp} tensor-parallel GPUs must be on one node; nodes have {gpus_per_node}")
    bundles = [{"GPU": float(tp), "CPU": cpus} for _ in range(replicas)] + [{"GPU": 1.0, "CPU": cpus}] * ranks
    return Layout(mode, ranks, replicas, tp, True, [dict(b) for b in bundles],
                  list(range(replicas, replicas + ranks)), list(range(replicas)),
                  {"num_gpus": 1.0, "num_cpus": cpus}, {"num_gpus": float(tp), "num_cpus": cpus})


def start_ray(address: str | None = None, num_cpus: float | None = None) -> Any:
    """Join `address` (an existing cluster) or start Ray on this machine; reuse a running session."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("trainer.placement colocated/split runs on Ray: pip install 'turnrl[ray]'") from exc
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(num_cpus=int(num_cpus) if num_cpus else None, include_dashboard=False, log_to_driver=True)
    return ray


def cluster_gpus_per_node(nodes: int) -> int:
    import ray
    gpus = int(ray.cluster_resources().get("GPU", 0))
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if len(alive) < nodes:
        raise ValueError(f"trainer.nodes={nodes} but the Ray cluster has {len(alive)} node(s)")
    return gpus // nodes


def reserve(layout: Layout, timeout_s: float = 120.0) -> Any:
    """A placement group for the layout, ready, or a ValueError that says what was missing."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    group = placement_group(layout.bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ValueError(f"Ray could not place {layout.describe()} (bundles {layout.bundles}) within "
                         f"{timeout_s:.0f} s; the cluster has {ray.cluster_resources()}")
    return group


def actor_options(group: Any, bundle: int, resources: dict[str, float]) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
            "num_gpus": resources.get("num_gpus", 0), "num_cpus": resources.get("num_cpus", 1),
            "max_restarts": 0}
