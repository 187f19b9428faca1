"""Scale-out on Ray: engine replicas and data-parallel training ranks as actors (`trainer.placement`).

    placement.py      Ray started or joined; a placement group: split (own GPUs) or colocated (shared GPUs)
    replicas.py       an engine per actor (hf or vllm), and the pool that replaces dead ones
    router.py         one Engine over the replicas: load-aware, sticky per trajectory, retries on death
    ranks.py          FSDP2 training ranks (NCCL on GPUs, gloo on CPUs); full-state checkpoints
    balance.py        rows dealt to ranks by tokens; equal micro-batch counts; the global normalizer
    sync.py           weights from ranks to replicas: NCCL broadcast, CUDA IPC, or Ray's object store
    async_rollout.py  batches sampled ahead of the update, within `trainer.max_staleness`
    trainer.py        the RL loop on top of them (`turnrl train` with placement colocated or split)
"""
