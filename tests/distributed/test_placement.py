"""Where actors go: split and colocated layouts on GPUs and CPUs, and the errors that say what to change."""

import pytest

from turnrl.distributed.placement import plan_layout
from turnrl.distributed.sync import resolve_transport


def test_split_gives_engines_and_ranks_their_own_gpus():
    layout = plan_layout("split", nodes=1, gpus_per_node=2, ranks=0, replicas=0, tp=1, cpus=1)
    assert (layout.replicas, layout.ranks) == (1, 1)
    assert layout.bundles == [{"GPU": 1.0, "CPU": 1}, {"GPU": 1.0, "CPU": 1}]
    assert layout.replica_bundle == [0] and layout.rank_bundle == [1]
    big = plan_layout("split", nodes=2, gpus_per_node=8, ranks=8, replicas=0, tp=2, cpus=1)
    assert (big.replicas, big.ranks) == (4, 8)
    assert [b["GPU"] for b in big.bundles] == [2.0] * 4 + [1.0] * 8
    with pytest.raises(ValueError, match="<= GPUs"):
        plan_layout("split", nodes=1, gpus_per_node=2, ranks=2, replicas=1, tp=1, cpus=1)
    with pytest.raises(ValueError, match="one node"):
        plan_layout("split", nodes=4, gpus_per_node=2, ranks=1, replicas=1, tp=4, cpus=1)


def test_colocated_shares_each_gpu_between_a_rank_and_a_replica():
    layout = plan_layout("colocated", nodes=1, gpus_per_node=4, ranks=0, replicas=0, tp=1, cpus=1)
    assert (layout.replicas, layout.ranks) == (4, 4)
    assert layout.rank_bundle == layout.replica_bundle == [0, 1, 2, 3]
    assert layout.rank_resources["num_gpus"] + layout.replica_resources["num_gpus"] == 1.0
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        plan_layout("colocated", nodes=1, gpus_per_node=4, ranks=0, replicas=0, tp=2, cpus=1)
    with pytest.raises(ValueError, match="engine.replicas=4"):
        plan_layout("colocated", nodes=1, gpus_per_node=4, ranks=0, replicas=2, tp=1, cpus=1)


def test_without_gpus_every_actor_gets_cpus():
    split = plan_layout("split", nodes=1, gpus_per_node=0, ranks=2, replicas=2, tp=1, cpus=1)
    assert split.bundles == [{"CPU": 1}] * 4 and not split.gpu
    together = plan_layout("colocated", nodes=1, gpus_per_node=0, ranks=2, replicas=0, tp=1, cpus=1)
    assert together.rank_bundle == together.replica_bundle == [0, 1]


def test_weight_sync_follows_the_placement():
    assert resolve_transport("auto", "split", gpu=True) == "broadcast"
    assert resolve_transport("auto", "colocated", gpu=True) == "ipc"
    assert resolve_transport("auto", "split", gpu=False) == "object_store"
    assert resolve_transport("broadcast", "split", gpu=False) == "broadcast"   # gloo: how the tests run it
    with pytest.raises(ValueError, match="colocated"):
        resolve_transport("ipc", "split", gpu=True)


def test_config_refuses_what_ray_placement_cannot_do():
    from turnrl.config import load_config
    from turnrl.config.loader import ConfigError
    with pytest.raises(ConfigError, match="placement"):
        load_config(None, ["trainer.async_rollout=true"])
    with pytest.raises(ConfigError, match="split"):
        load_config(None, ["trainer.placement=colocated", "trainer.async_rollout=true"])
    cfg = load_config(None, ["trainer.placement=split", "trainer.async_rollout=true", "engine.replicas=2"])
    assert cfg.trainer.max_staleness == 1 and cfg.engine.replicas == 2
