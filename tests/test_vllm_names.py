"""Every name vLLM's EngineArgs and SamplingParams accept is accepted here, or refused with a
ValueError naming it: never a bare TypeError, whatever the value. The names are read from vLLM's
source (vllm/engine/arg_utils.py and vllm/sampling_params.py, v0.11 era, plus older names its
examples still use) and written down here, so the suite needs no vLLM."""

import re

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

VLLM_ENGINE_ARGS = """
model served_model_name tokenizer hf_config_path runner convert task skip_tokenizer_init enable_prompt_embeds
tokenizer_mode trust_remote_code allowed_local_media_path allowed_media_domains download_dir
safetensors_load_strategy load_format config_format dtype kv_cache_dtype seed max_model_len cuda_graph_sizes
cudagraph_capture_sizes max_cudagraph_capture_size distributed_executor_backend pipeline_parallel_size
tensor_parallel_size decode_context_parallel_size data_parallel_size data_parallel_rank data_parallel_start_rank
data_parallel_size_local data_parallel_address data_parallel_rpc_port data_parallel_hybrid_lb data_parallel_backend
enable_expert_parallel all2all_backend enable_dbo dbo_decode_token_threshold dbo_prefill_token_threshold
disable_nccl_for_dp_synchronization eplb_config enable_eplb expert_placement_strategy num_redundant_experts
eplb_window_size eplb_step_interval eplb_log_balancedness max_parallel_loading_workers block_size
enable_prefix_caching prefix_caching_hash_algo disable_sliding_window disable_cascade_attn swap_space cpu_offload_gb
gpu_memory_utilization kv_cache_memory_bytes max_num_batched_tokens max_num_partial_prefills
max_long_partial_prefills long_prefill_token_threshold max_num_seqs max_logprobs logprobs_mode disable_log_stats
aggregate_engine_logging revision code_revision rope_scaling rope_theta hf_token hf_overrides tokenizer_revision
quantization enforce_eager disable_custom_all_reduce limit_mm_per_prompt enable_mm_embeds interleave_mm_strings
media_io_kwargs mm_processor_kwargs disable_mm_preprocessor_cache mm_processor_cache_gb mm_processor_cache_type
mm_shm_cache_max_object_size_mb mm_encoder_tp_mode mm_encoder_attn_backend io_processor_plugin skip_mm_profiling
video_pruning_rate enable_lora max_loras max_lora_rank default_mm_loras fully_sharded_loras max_cpu_loras lora_dtype
lora_extra_vocab_size ray_workers_use_nsight num_gpu_blocks_override num_lookahead_slots model_loader_extra_config
ignore_patterns enable_chunked_prefill disable_chunked_mm_input disable_hybrid_kv_cache_manager
structured_outputs_config reasoning_parser guided_decoding_backend guided_decoding_disable_fallback
guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties logits_processor_pattern
speculative_config show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces scheduling_policy
scheduler_cls pooler_config override_pooler_config compilation_config worker_cls worker_extension_cls
kv_transfer_config kv_events_config generation_config enable_sleep_mode override_generation_config model_impl
override_attention_dtype calculate_kv_scales mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size
additional_config use_tqdm_on_load pt_load_map_location enable_multimodal_encoder_data_parallel logits_processors
async_scheduling kv_sharing_fast_prefill
device use_v2_block_manager num_scheduler_steps speculative_model num_speculative_tokens preemption_mode
max_seq_len_to_capture disable_async_output_proc
""".split()
VLLM_ASYNC_ENGINE_ARGS = ["enable_log_requests", "disable_log_requests"]

VLLM_SAMPLING_PARAMS = """
n best_of presence_penalty frequency_penalty repetition_penalty temperature top_p top_k min_p seed stop
stop_token_ids ignore_eos max_tokens min_tokens logprobs prompt_logprobs flat_logprobs detokenize skip_special_tokens
spaces_between_special_tokens logits_processors include_stop_str_in_output truncate_prompt_tokens output_kind
skip_clone output_text_buffer_length structured_outputs guided_decoding logit_bias allowed_token_ids extra_args
bad_words skip_reading_prefix_cache
""".split()

# values that trip naive code: None, unhashable containers, wrong types, a bool where a number goes
VALUES = [None, {"x": 1}, [1], "x", 2, 0.5, True, {}]


def accepted_or_named(make, name: str, value) -> None:
    try:
        make(**{name: value})
    except ValueError as e:
        assert (re.search(rf"\b{re.escape(name)}\b",
                          str(e))), f"{name}={value!r}: the error does not name it: {e}"
    except Exception as e:  # a TypeError, KeyError, ...: what the engine promises never to raise
        pytest.fail(f"{name}={value!r} raised {type(e).__name__}: {e}")


@pytest.mark.parametrize("name", VLLM_ENGINE_ARGS + VLLM_ASYNC_ENGINE_ARGS)
def test_vllm_engine_arg(name):
    make = AsyncEngineArgs if name in VLLM_ASYNC_ENGINE_ARGS else EngineArgs
    for value in VALUES:
        accepted_or_named(lambda **kw: make(**kw).create_engine_config(), name, value)


@pytest.mark.parametrize("name", VLLM_SAMPLING_PARAMS)
def test_vllm_sampling_param(name):
    for value in VALUES:
        accepted_or_named(SamplingParams, name, value)


def test_the_same_checks_guard_llm_itself():
    """LLM() goes through EngineArgs: the issue's TypeErrors are ValueErrors naming the argument."""
    for kwargs in ({"hf_overrides": {"rope_theta": 1.0}}, {"enable_eplb": True},
                   {"no_such_thing": 1}):
        (name,) = kwargs
        with pytest.raises(ValueError, match=name):
            LLM(**kwargs)
    llm = LLM(mm_processor_kwargs={"num_crops": 4}, limit_mm_per_prompt={"image": 5},
              hf_overrides={}, num_kv_blocks=16)  # harmless for a text-only model: accepted
    assert llm.engine.kv.pool.num_blocks == 16


def test_known_names_are_all_fields_here():
    """Most of vLLM's names are refused; these must be real knobs here (the table did not lose
    one)."""
    supported = {"model", "served_model_name", "tokenizer", "dtype", "seed", "max_model_len",
                 "block_size", "enable_prefix_caching", "swap_space", "gpu_memory_utilization",
                 "kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_seqs", "revision",
                 "tokenizer_revision", "download_dir", "enforce_eager", "enable_chunked_prefill",
                 "speculative_config", "scheduling_policy", "generation_config", "device",
                 "speculative_model", "num_speculative_tokens", "preemption_mode"}
    for name in supported:
        EngineArgs(**{name: getattr(EngineArgs(), name)}).create_engine_config()
