"""The model, its LoRA adapter and the rollout engine: `model.*`, `model.lora.*`, `engine.*`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from turnrl.config.checks import positive
from turnrl.config.loader import ConfigError


@dataclass
class LoraConfig:
    rank: int = 0                        # 0 = full fine-tuning
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"

    def validate(self) -> None:
        positive("rank", self.rank, allow_zero=True)
        positive("alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"'dropout' must be in [0, 1), got {self.dropout}.")


@dataclass
class ModelConfig:
    # keys that once existed and did nothing: an old config that sets one learns what to do instead (the loader)
    removed_keys: ClassVar[dict[str, str]] = {
        "dtype": "set trainer.dtype (training) and engine.dtype (sampling) instead"}
    name: str = "smollm2-135m-instruct"  # built-in alias, local HF dir, or cached hub id
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    chat_template: str | None = None     # a Jinja file replacing the tokenizer's chat template (none: the model's)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables, e.g. enable_thinking

    def validate(self) -> None:
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise ConfigError(f"'chat_template' must be the path of a Jinja chat template file, got "
                              f"{self.chat_template!r} (no such file).")


VLLM_LORA_RANKS = (0, 1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class EngineConfig:
    kind: Literal["hf", "vllm", "vllm_server"] = "hf"
    device: str = "auto"                 # auto | cpu | cuda | cuda:N  (hf engine)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = 64             # hf: sequences decoded together
    gather_ms: float = 5.0               # hf: how long a batch waits for more requests
    seed: int = 0
    prefix_cache_tokens: int = 32768     # hf (plain engine): KV of up to this many tokens kept for reuse by later
    #                                      turns and sibling samples (0 or enable_prefix_caching=false: off)
    fast: Literal["auto", "on", "off"] = "auto"  # hf: the fast engine (slot KV cache of max_batch_size x
    #                                      max_model_len, CUDA graphs, device sampling); auto: on CUDA
    fast_prefix_cache: bool = True       # hf fast engine: later turns continue their parked slot, groups copy the
    #                                      prompt KV (9x fewer prefilled tokens; multi-turn phase 1.14 s against
    #                                      1.58 s without, H100: README "Prefix cache in the fast engine")
    fast_admission_graphs: bool = False  # hf fast engine with CUDA graphs: admissions padded to buckets, one
    #                                      graph launch each (turnrl/engines/fast/admit.py); off by default: on H100s
    #                                      the padding slowed the offline phase ~0.3 s and the multi-turn one did
    #                                      not gain (README "Admissions as CUDA graphs"); false: eager, exact sizes
    cpu_gemm: bool = True                # hf plain engine, float32 on an AVX-512 CPU: decode steps' weight products
    #                                      through turnrl's skinny kernel, built with the system's g++ on first use
    #                                      (turnrl/engines/cpu_gemm.py; at 8 rows 23 ms against 38 with linear);
    #                                      checked against the model's forward, linear where it is not within 1e-4
    exact: bool = False                  # hf: engine and trainer logprobs equal bit for bit, tokens independent of
    #                                      the batch (batch-invariant forward of turnrl/exact; slot engine, eager)
    gc_freeze: bool = True               # once the engine is built, and after the first step or warm-up, the
    #                                      process's live objects leave the garbage collector's full collections
    #                                      (gc.freeze; turnrl/observe/gc_heap.py): no 0.1-0.3 s pauses of all threads
    partial_rollout: bool = False        # with trainer.async_rollout: a weight sync interrupts the requests in
    #                                      flight, which go on from their sampled tokens on the new weights
    #                                      (turnrl/engines/resume.py; hf, fast, vllm, vllm_server)
    # vLLM
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    cpu_kv_cache_gb: float = 2.0         # vllm on CPU: KV cache size (GPU: gpu_memory_utilization)
    max_num_seqs: int = 0                # vllm: sequences scheduled together (0: vLLM's default, 128 here); the
    #                                      rest of rollout.concurrency waits in vLLM's queue
    cpu_threads: int = 0                 # vllm on CPU (in-process): the engine's threads (0: the trainer's torch
    #                                      threads, since rollout and update take turns; 1 where other work
    #                                      shares the cores during rollout)
    max_lora_rank: int = 0               # vllm: > 0 adds a LoRA slot so adapters sync alone (>= model.lora.rank)
    enable_sleep_mode: bool = False      # vllm on GPU: allow engine.sleep()/wake_up() to free GPU memory
    # Ray (trainer.placement colocated/split)
    replicas: int = 0                    # engine replicas, each an actor on tensor_parallel_size GPUs (0: auto)
    request_retries: int = 2             # a request whose replica died is retried on another this many times
    # vLLM servers (kind vllm_server; README "Rolling out on vLLM servers")
    urls: list[str] = field(default_factory=list)  # running servers (python -m turnrl.engines.vllm_launch ...)
    launch: int = 0                      # > 0: turnrl starts this many servers itself (instead of urls)
    launch_timeout_s: float = 600.0
    served_model_name: str = "turnrl-policy"
    transfer_dir: str = ""               # where weight files for the servers go ("" = /dev/shm); shared storage
    #                                      when a server runs on another host
    request_timeout_s: float = 600.0
    revive_timeout_s: float = 600.0      # how long a restarted server may take to come back

    def validate(self) -> None:
        if self.kind == "vllm_server" and bool(self.urls) == bool(self.launch):
            raise ConfigError("engine.kind=vllm_server needs either engine.urls (running servers) or engine.launch "
                              "(how many servers turnrl starts), not both" if self.urls else
                              "engine.kind=vllm_server needs engine.urls=[http://host:port, ...] (running servers) "
                              "or engine.launch=N (turnrl starts N servers)")
        if self.kind != "vllm_server" and (self.urls or self.launch):
            raise ConfigError(f"engine.urls and engine.launch are for engine.kind=vllm_server, not {self.kind!r}")
        positive("launch", self.launch, allow_zero=True)
        positive("request_timeout_s", self.request_timeout_s)
        positive("max_batch_size", self.max_batch_size)
        positive("gather_ms", self.gather_ms, allow_zero=True)
        positive("prefix_cache_tokens", self.prefix_cache_tokens, allow_zero=True)
        positive("max_model_len", self.max_model_len)
        positive("tensor_parallel_size", self.tensor_parallel_size)
        positive("cpu_kv_cache_gb", self.cpu_kv_cache_gb)
        positive("max_num_seqs", self.max_num_seqs, allow_zero=True)
        positive("replicas", self.replicas, allow_zero=True)
        positive("request_retries", self.request_retries, allow_zero=True)
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ConfigError(f"'max_lora_rank' must be one of {VLLM_LORA_RANKS} (0 = no LoRA slot; vLLM's sizes), "
                              f"got {self.max_lora_rank}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"'gpu_memory_utilization' must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.exact and (self.kind != "hf" or self.fast == "off"):
            raise ConfigError("'exact' needs the embedded slot engine, whose forward the trainer shares: set "
                              "kind: hf and fast: auto or on (vLLM's kernels cannot match the trainer's bit for "
                              "bit; keep exact: false there and watch the mismatch/* metrics).")
