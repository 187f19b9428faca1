"""The in-process vLLM engine's settings and the EngineArgs keywords they become (no vLLM needed)."""

from __future__ import annotations

import pytest

from turnrl.engines.vllm_args import VLLMSettings, check_settings, engine_args, resolved_dtype


@pytest.mark.parametrize("change, message", [
    ({"dtype": "fp8"}, "dtype must be one of"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=1"),
    ({"max_model_len": 0}, "max_model_len > 0"),
    ({"cpu_kv_cache_gb": 0.0}, "cpu_kv_cache_gb > 0"),
    ({"max_num_seqs": -1}, "max_num_seqs >= 0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization <= 1"),
    ({"gpu_memory_utilization": 0.0}, "0 < gpu_memory_utilization"),
])
def test_settings_the_engine_cannot_run_are_refused_with_what_to_set(change, message):
    with pytest.raises(ValueError, match=message):
        check_settings(VLLMSettings("m", **change))


def test_negative_threads_and_the_kv_environment_variable_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="engine.cpu_threads must be >= 0"):
        check_settings(VLLMSettings("m"), cpu_threads=-1)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    with pytest.raises(ValueError, match="unset it and set engine.cpu_kv_cache_gb"):
        check_settings(VLLMSettings("m"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    check_settings(VLLMSettings("m"), cpu_threads=2)


def test_auto_dtype_is_float32_only_on_a_cpu_without_native_bf16():
    assert resolved_dtype("auto", on_cpu=True, cpu_has_native_bf16=False) == "float32"
    assert resolved_dtype("auto", on_cpu=True, cpu_has_native_bf16=True) == "auto"
    assert resolved_dtype("auto", on_cpu=False, cpu_has_native_bf16=False) == "auto"
    assert resolved_dtype("bfloat16", on_cpu=True, cpu_has_native_bf16=False) == "bfloat16"


def test_cpu_args_give_a_kv_budget_in_bytes_and_whole_prefills():
    args = engine_args(VLLMSettings("/models/x", max_model_len=2048, cpu_kv_cache_gb=1.5, seed=7), "float32",
                       on_cpu=True)
    assert args["model"] == "/models/x" and args["dtype"] == "float32" and args["seed"] == 7
    assert args["kv_cache_memory_bytes"] == int(1.5 * (1 << 30))
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 4096
    assert "gpu_memory_utilization" not in args and "max_num_seqs" not in args and "enable_lora" not in args
    # token ids in and out, logprobs after the temperature, one in-process worker, no model sampling defaults
    assert args["skip_tokenizer_init"] is True and args["logprobs_mode"] == "processed_logprobs"
    assert args["distributed_executor_backend"] == "uni" and args["generation_config"] == "vllm"


def test_gpu_args_give_a_memory_fraction_and_lora_slots_when_asked():
    args = engine_args(VLLMSettings("m", gpu_memory_utilization=0.3, max_lora_rank=16, max_num_seqs=128,
                                    enable_sleep_mode=True), "bfloat16", on_cpu=False)
    assert args["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in args
    assert args["enable_lora"] is True and args["max_lora_rank"] == 16 and args["max_loras"] == 1
    assert args["max_num_seqs"] == 128 and args["enable_sleep_mode"] is True
    assert "enable_chunked_prefill" not in args


def test_a_cpu_batch_budget_covers_the_longest_prompt_and_every_sequence():
    assert engine_args(VLLMSettings("m", max_model_len=8192), "auto", True)["max_num_batched_tokens"] == 8192
    assert engine_args(VLLMSettings("m", max_num_seqs=5000), "auto", True)["max_num_batched_tokens"] == 5000
