"""The public members of DeepSpeed 0.19.8's ``DeepSpeedEngine``, for the error that names a member the torsh
engine lacks (:meth:`torsh.engine.engine.Engine.__getattr__`), and ``engine._config``, DeepSpeed's view of the
engine's config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Public members of DeepSpeed 0.19.8's ``DeepSpeedEngine`` (methods and attributes), for the error that names
#: a member the torsh engine lacks.
DEEPSPEED_ENGINE_MEMBERS = frozenset("""
aio_config all_gather_scalar all_to_all_group allreduce_and_copy allreduce_bucket allreduce_gradients
allreduce_no_retain autotp_size autotuning_enabled autotuning_end_profile_step autotuning_metric
autotuning_metric_path autotuning_model_info autotuning_model_info_path autotuning_profile_model_info
autotuning_start_profile_step backward basic_optimizer bf16_master_weights_and_gradients bf16_optimizer_states
bfloat16_enabled buffered_allreduce_fallback checkpoint_engine checkpoint_mp_rank checkpoint_serialization_enabled
checkpoint_tag_validation_enabled checkpoint_tag_validation_fail checkpoint_writer_enabled client_lr_scheduler
client_optimizer clip_fp32_gradients coalesce_grad_reduction collate_fn collect_python_gc communication_data_type
compile compile_autosp compile_autotp compile_zero_optimization_stage config cpuadam_cores_perc
curriculum_learning_config curriculum_learning_enabled data_efficiency_config data_efficiency_enabled
data_parallel_group data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io destroy device
dist_backend dont_change_device dp_world_size dump_state dynamic_loss_scale dynamic_loss_scale_args
empty_partition_cache enable_backward_allreduce engine_timers engine_timers_cache eval expert_data_parallel_group
expert_parallel_group first_dataloader_check flatten flops flops_profiler flops_profiler_detailed
flops_profiler_enabled flops_profiler_module_depth flops_profiler_output_file flops_profiler_profile_step
flops_profiler_recompute_fwd_factor flops_profiler_top_modules forward fp16_auto_cast fp16_enabled
fp16_master_weights_and_gradients fwd_duration gate_modules get_autosp_backend get_autotp_backend get_batch_info
get_compile_time get_data_parallel_rank get_data_types get_deepcompile_backend get_deepspeed_compile_backend
get_global_grad_norm get_lr get_model_parallel_rank get_mom get_optimizer_configuration get_sequence_parallel_group
get_tensor_parallel_rank get_type get_wall_clock_timers global_rank global_samples global_steps
gradient_accumulation_steps gradient_average gradient_clipping gradient_predivide_factor has_moe_layers
initial_dynamic_scale inside_no_sync_ctxt is_compiled is_deepcompile_active is_deepcompile_enabled
is_first_weights_partition_group is_gradient_accumulation_boundary is_iterable_style_dataset is_map_style_dataset
is_sanity_checks_enabled load_checkpoint load_module_state_dict load_moe_state_dict load_universal_checkpoint
loaded_checkpoint_dp_world_size loaded_checkpoint_mp_world_size local_all_to_all_group local_rank log_level
loss_scale losses lr_scheduler managed_gradient_accumulation memory_breakdown mesh_device micro_steps
module_forward_post_hook module_forward_pre_hook module_state_dict moe_layers monitor mp_world_size mpu no_sync
num_experts offload_states optimized_linear_base_weight_sharding optimized_linear_lora_enabled optimizer
optimizer_legacy_fusion optimizer_name optimizer_params param_names pipeline_parallelism postscale_gradients
print_forward_breakdown random_ltd_config random_ltd_enabled random_ltd_initialize random_ltd_scheduler
register_compile_pass reload_states save_16bit_model save_checkpoint save_fp16_model save_non_zero_checkpoint
save_zero_checkpoint scale scale_wrt_gas scheduler_name scheduler_params seq_data_parallel_group seq_dp_world_size
seq_parallel_group sequence_parallel_size set_custom_curriculum_learning_schedule set_data_post_process_func
set_gradient_accumulation_boundary set_train_batch_size set_train_micro_batch_size skipped_steps sparse_all_gather
sparse_allreduce sparse_allreduce_bucket sparse_allreduce_no_retain step steps_per_print summary_events
super_offload swap_tensor_config tensor_parallel_config timers torch_autocast_dtype torch_autocast_enabled
torch_autocast_lower_precision_safe_modules torch_autocast_z0_gradscaler tput_timer train train_batch_size
train_micro_batch_size_per_gpu training_data training_dataloader unflatten update_interval use_ds_comm
use_node_local_storage uses_parallelization_pass_only wall_clock_breakdown warn_unscaled_loss was_step_applied
world_size zenflow_config zero_allgather_bucket_size zero_allgather_partitions zero_allgather_sequential
zero_allow_untested_optimizer zero_compute_grad_norm zero_contiguous_gradients zero_cpu_offload
zero_elastic_checkpoint zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save zero_grad
zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights
zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance zero_model_persistence_threshold
zero_module_granularity_threshold zero_multi_rank_bucket_allreduce zero_nvme_offload_optimizer
zero_offload_optimizer zero_offload_param zero_optimization zero_optimization_partition_gradients
zero_optimization_partition_weights zero_optimization_stage zero_overlap_comm zero_param_persistence_threshold
zero_parameter_alignment zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients
zero_quantized_nontrainable_weights zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter
zero_round_robin_gradients zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer
""".split())



@dataclass(frozen=True)
class ConfigView:
    """DeepSpeed's names for the values the engine runs with: ``engine._config`` when no layer above gives
    DeepSpeed's own ``DeepSpeedConfig`` (:func:`register_config_view`)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    zero_optimization_stage: int
    zero_enabled: bool
    fp16_enabled: bool
    bfloat16_enabled: bool
    gradient_clipping: float
    log_level: str | None


#: Builds ``engine._config`` from an engine; a layer above the engine registers DeepSpeed's ``DeepSpeedConfig``
#: reader here (the DeepSpeed compatibility package, when it loads), so that the engine never imports that layer.
_config_view: Callable[[Any], Any] | None = None


def register_config_view(build: Callable[[Any], Any]) -> None:
    """Make ``build(engine)`` what ``engine._config`` is (on first access, per engine)."""
    global _config_view
    _config_view = build


def config_view(engine: Any) -> Any:
    """``engine._config``: the registered view (DeepSpeed's ``DeepSpeedConfig`` of the engine), else a
    :class:`ConfigView` of the values the engine runs with."""
    if _config_view is not None:
        return _config_view(engine)
    stage = engine.zero_optimization_stage()
    return ConfigView(train_batch_size=engine.train_batch_size(),
                      train_micro_batch_size_per_gpu=engine.train_micro_batch_size_per_gpu(),
                      gradient_accumulation_steps=engine.gradient_accumulation_steps(), zero_optimization_stage=stage,
                      zero_enabled=stage > 0, fp16_enabled=engine.fp16_enabled(),
                      bfloat16_enabled=engine.bfloat16_enabled(), gradient_clipping=engine._clip,
                      log_level=engine.config.get("log_level") if isinstance(engine.config, dict) else None)
