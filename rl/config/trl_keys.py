"""TRL's keys that have no effect in this package, each with the reason: the one table of them.

A TRL recipe file (`trl sft --config recipe.yaml`: ScriptArguments + ModelConfig + the trainer's config, i.e.
TrainingArguments and TRL's own fields, in one YAML) runs here unchanged. Every field of TRL 1.16's configs is
either honoured with TRL's meaning (a schema field of the same name, or an alias in rl.config.vocabulary.ALIASES)
or listed here. A listed key is accepted and left out of the config; when its value asks for something (it is
not among the values that ask for nothing, normally TRL's default) it prints one line on the main process,
`note: key 'vllm_device' is accepted and ignored (<reason>)`. tests/unit/config/test_trl_keys.py introspects TRL's dataclasses
and fails on a field that is neither honoured nor listed, so a TRL upgrade shows what is new.

Three kinds, kept apart so that the coverage figure is honest (docs/coming-from-trl.md prints it):
  NOT_APPLICABLE   the setting has no counterpart here (HF Trainer plumbing: data loaders, DDP knobs, FSDP...)
  SAME_HERE        this package always does what the listed values mean (e.g. one generation batch per step)
  NOT_IMPLEMENTED  a TRL feature this package does not have (yet)
A key is only consulted for a schema that has no field or alias of that name: `loss_type` is DPO's and GRPO's
own key; only in SFT (TRL's nll/dft) does it land here.
"""

from __future__ import annotations

from typing import Any

ANY = object()  # in a value tuple: every value asks for nothing (the key is a no-op everywhere)
ALWAYS = ()  # no value asks for nothing: the note is printed whenever the key is given

# key -> (values that ask for nothing: no line, the reason)
NOT_APPLICABLE: dict[str, tuple[tuple, str]] = {
    # data loading: the data is read and tokenised once before training, in the main process
    "dataloader_drop_last": ((False,), "no data loader here: a short last step trains on what is left "
                             "(rl.config.plan.epoch_plan)"),
    "dataloader_num_workers": ((0,), "no data loader here: the data is tokenised once before training"),
    "dataloader_pin_memory": ((True, False), "no data loader here"),
    "dataloader_persistent_workers": ((False,), "no data loader here"),
    "dataloader_prefetch_factor": ((None,), "no data loader here"),
    "dataloader_multiprocessing_context": ((None,), "no data loader here"),
    "dataloader_in_order": ((True,), "no data loader here"),
    "dataset_num_proc": ((None,), "the data is read and tokenised in one process here"),
    "dataset_kwargs": ((None,), "no dataset preparation step to configure here"),
    "remove_unused_columns": ((True, False), "the rows' other columns reach the reward functions (TRL's GRPO "
                              "behaviour); training batches hold only what the loss needs"),
    "label_names": ((None,), "the trainers know their own labels"),
    "length_column_name": (("length",), "no group_by_length sampler here"),
    # distributed plumbing: accelerate and DeepSpeed configure the processes
    "ddp_find_unused_parameters": ((None,), "DDP is set up by accelerate here"),
    "ddp_bucket_cap_mb": ((None,), "DDP is set up by accelerate here"),
    "ddp_broadcast_buffers": ((None,), "DDP is set up by accelerate here"),
    "ddp_static_graph": ((None,), "DDP is set up by accelerate here"),
    "ddp_backend": ((None,), "accelerate picks the backend (gloo on CPUs, nccl on GPUs)"),
    "ddp_timeout": ((1800,), "accelerate's default process-group timeout applies"),
    "local_rank": ((-1,), "set by the launcher (accelerate launch / torchrun) here"),
    "accelerator_config": ((None,), "pass accelerate's settings to `accelerate launch` (--config_file)"),
    "parallelism_config": ((None,), "pass accelerate's settings to `accelerate launch` (--config_file)"),
    "save_on_each_node": ((False,), "the main process writes checkpoints to a shared output_dir"),
    "log_on_each_node": ((True, False), "only the main process logs here"),
    "ignore_bias_buffers": ((False,), "no DDP bias-buffer workaround is needed here"),
    # HF Trainer's evaluate()/predict() plumbing: the trainers compute their own eval metrics
    "prediction_loss_only": ((False, True), "each trainer computes its own eval metrics"),
    "eval_do_concat_batches": ((True,), "each trainer computes its own eval metrics"),
    "eval_use_gather_object": ((False,), "each trainer computes its own eval metrics"),
    "eval_accumulation_steps": ((None,), "each trainer computes its own eval metrics"),
    "include_for_metrics": (([],), "each trainer computes its own eval metrics (no compute_metrics)"),
    "batch_eval_metrics": ((False,), "each trainer computes its own eval metrics (no compute_metrics)"),
    "do_train": ((ANY,), "HF's Trainer does not read it either (a flag for scripts)"),
    "do_eval": ((ANY,), "HF's Trainer does not read it either; eval_strategy decides"),
    "do_predict": ((ANY,), "HF's Trainer does not read it either (a flag for scripts)"),
    "debug": (("", None, []), "HF's debug modes (underflow_overflow, tpu_metrics) have no counterpart here"),
    "skip_memory_metrics": ((True,), "memory is planned by --dry-run here"),
    "restore_callback_states_from_checkpoint": ((False,), "no callbacks here"),
    "ignore_data_skip": ((False,), "a resume restores the data position exactly, without skipping batches"),
    "log_level": (("passive",), "the console shows one line per logging step; verbose: true shows the libraries' "
                  "logs"),
    "log_level_replica": (("warning",), "only the main process prints here"),
    "disable_tqdm": ((None,), "the progress bar appears on a terminal only"),
    "trackio_space_id": ((None, "trackio"), "trackio runs locally here (report_to: [trackio])"),
    "trackio_bucket_id": ((None,), "trackio runs locally here (report_to: [trackio])"),
    "trackio_static_space_id": ((None,), "trackio runs locally here (report_to: [trackio])"),
    "hub_always_push": ((False, True), "pushes are synchronous here: none is ever skipped"),
    "enable_jit_checkpoint": ((False, True), "a stop signal (SIGTERM, SIGUSR1, Ctrl-C) always writes a checkpoint "
                              "here"),
    "logging_nan_inf_filter": ((True,), "a NaN or infinite loss stops the run here (nothing is saved at that step)"),
    "use_cache": ((False, True), "training forwards never keep a KV cache here; generation always does"),
    "cache_implementation": ((None,), "our sampler's KV cache is its own (rl.engine.generation)"),
    "lora_task_type": (("CAUSAL_LM", "SEQ_CLS"), "the task follows the trainer (causal LM; sequence classifier "
                       "for reward models)"),
    "vllm_device": (ALWAYS, "TRL's former key: the engine's device follows vllm_mode (colocate: each training "
                    "process's own GPU; server: where `rl vllm-serve` runs)"),
    "use_liger": ((False,), "Liger's Triton kernels are not used here (TRL's former name of use_liger_kernel)"),
    "num_generations_eval": ((None,), "evaluation here scores one greedy completion per prompt"),
    "log_multimodal": ((True, False), "text models only here"),
}

# key -> (the values that mean what this package always does, what that is)
SAME_HERE: dict[str, tuple[tuple, str]] = {
    "average_tokens_across_devices": ((True,), "the loss is always normalised by the tokens of the whole step on "
                                      "all processes here"),
    "truncation_mode": (("keep_start",), "examples longer than max_length keep their start here (prompts of the "
                        "preference trainers keep their end, max_prompt_length)"),
    "ds3_gather_for_generation": ((True,), "under ZeRO-3 the policy's weights are always gathered for generation "
                                  "here"),
    "shuffle_dataset": ((True, False), "the online trainers draw prompts in a seeded shuffled order, SFT reshuffles "
                        "each epoch"),
    "generation_batch_size": ((None,), "one generation batch per optimizer step here (TRL's default); "
                              "num_iterations reuses it"),
    "steps_per_generation": ((None,), "one generation batch per optimizer step here (TRL's default)"),
    "vllm_model_impl": (("vllm",), "vLLM's own model implementation is used"),
    "bf16_full_eval": ((False,), "evaluation runs in the training precision here"),
    "fp16_full_eval": ((False,), "evaluation runs in the training precision here"),
    "f_divergence_type": (("reverse_kl",), "DPO's regulariser is the reverse KL here (f-DPO is not implemented)"),
    "f_alpha_divergence_coef": ((0.5,), "f-DPO is not implemented here"),
    "repetition_penalty": ((1.0,), "sampling has no repetition penalty here"),
    "pad_to_multiple_of": ((None, "auto"), "sequences are padded to the micro-batch's longest (or packed) here"),
    "train_sampling_strategy": (("random", "sequential"), "epochs are shuffled by seed (KTO: `shuffle`)"),
    "use_transformers_paged": ((False,), "generation uses this package's sampler or vLLM (use_vllm)"),
    "use_transformers_continuous_batching": ((False,), "generation uses this package's sampler or vLLM (use_vllm)"),
    "transformers_continuous_batching_config": ((None,), "generation uses this package's sampler or vLLM"),
    "eval_packing": ((None, True, False), "packing changes no loss value here (padding-free, per-example positions): "
                     "evaluation gives the same numbers packed or not"),
    "multi_objective_aggregation": (("sum_then_normalize",), "rewards are summed with reward_weights, then "
                                    "normalised per group (TRL's default)"),
}

# key -> (the values that ask for nothing, what is missing)
NOT_IMPLEMENTED: dict[str, tuple[tuple, str]] = {
    "fsdp": ((None, "", []), "FSDP is not supported: use DeepSpeed ZeRO-3 (deepspeed: ds_configs/zero3.json)"),
    "fsdp_config": ((None,), "FSDP is not supported: use DeepSpeed ZeRO-3 (deepspeed: ds_configs/zero3.json)"),
    "torch_compile": ((False,), "torch.compile is not applied here"),
    "torch_compile_backend": ((None,), "torch.compile is not applied here"),
    "torch_compile_mode": ((None,), "torch.compile is not applied here"),
    "use_liger_kernel": ((False,), "Liger's Triton kernels are not used here"),
    "liger_kernel_config": ((None,), "Liger's Triton kernels are not used here"),
    "auto_find_batch_size": ((False,), "not implemented: --dry-run plans the memory instead"),
    "optim_target_modules": ((None,), "GaLore/APOLLO optimizers are not implemented"),
    "label_smoothing_factor": ((0.0,), "label smoothing of SFT's cross-entropy is not implemented"),
    "include_num_input_tokens_seen": (("no", False), "not implemented"),
    "project": (("huggingface",), "not implemented; set the tracker's project by its environment variable "
                "(WANDB_PROJECT)"),
    "save_only_model": ((False,), "checkpoints always hold the optimizer state (resume needs it)"),
    "load_best_model_at_end": ((False,), "not implemented: the final model is the last step's"),
    "metric_for_best_model": ((None,), "not implemented: the final model is the last step's"),
    "greater_is_better": ((None,), "not implemented: the final model is the last step's"),
    "router_aux_loss_coef": ((None,), "the MoE load-balancing loss is not added"),
    "activation_offloading": ((False,), "activation offloading is not implemented (gradient_checkpointing saves "
                              "activation memory)"),
    "packing_strategy": (("bfd",), "SFT's packing packs each micro-batch's examples; TRL's bfd/wrapped packing into "
                         "max_length rows is not implemented"),
    "assistant_only_loss": ((False,), "the loss counts the last assistant message (completion_only_loss); every "
                            "assistant turn is not implemented"),
    "loss_type": (("nll", "kto"), "SFT's loss is the token cross-entropy (nll) and KTO's is kto here; DFT and "
                  "apo_zero_unpaired are not implemented"),
    "precompute_ref_batch_size": ((None,), "KTO computes its reference log-probs in each step"),
    "precompute_ref_log_probs": ((False,), "KTO computes its reference log-probs in each step"),
    "loss_weights": ((None,), "one preference loss per run here (MPO's weighted sum is not implemented)"),
    "ld_alpha": ((None,), "LD-DPO is not implemented"),
    "use_weighting": ((False,), "WPO weighting is not implemented"),
    "discopop_tau": ((0.05,), "the DiscoPOP loss is not implemented"),
    "cast_lm_head_to_fp32": ((False,), "not implemented (the trainable policy keeps fp32 master weights)"),
    "min_p": ((None,), "min-p sampling is not implemented (top_k, top_p)"),
    "generation_kwargs": ((None,), "sampling takes temperature, top_k, top_p and max_completion_length"),
    "chat_template_kwargs": ((None,), "chat-template keyword arguments are not implemented"),
    "vllm_structured_outputs_regex": ((None,), "structured outputs are not implemented"),
    "vllm_max_model_length": ((None,), "the engine's context is the model's"),
    "top_entropy_quantile": ((1.0,), "the high-entropy token mask is not implemented"),
    "entropy_coef": ((0.0,), "GRPO's entropy bonus is not implemented"),
    "use_adaptive_entropy": ((False,), "adaptive entropy control is not implemented"),
    "entropy_coef_min": ((0.0,), "adaptive entropy control is not implemented"),
    "entropy_coef_max": ((1.0,), "adaptive entropy control is not implemented"),
    "entropy_coef_delta": ((0.005,), "adaptive entropy control is not implemented"),
    "entropy_target": ((0.2,), "adaptive entropy control is not implemented"),
    "max_tool_calling_iterations": ((None,), "tool-calling turns are the environment's (env_type: tool_math)"),
    "off_policy_mask_threshold": ((None,), "off-policy sequence masking is not implemented"),
    "log_completions_hub_repo": ((None,), "completions are not pushed to the Hub"),
    "per_device_eval_batch_size": ((ANY,), "this trainer evaluates in batches of its own size"),
}

TABLES = (NOT_APPLICABLE, SAME_HERE, NOT_IMPLEMENTED)
_ALL = {k: v for table in TABLES for k, v in table.items()}


def _asks_nothing(value: Any, quiet: tuple) -> bool:
    if ANY in quiet:
        return True
    if isinstance(value, str) and value.lower() in ("none", "null"):
        value = None
    return any(value == q and type(value) is type(q) or (value is None and q is None)
               or (isinstance(q, (int, float)) and not isinstance(q, bool) and isinstance(value, (int, float))
                   and not isinstance(value, bool) and value == q) for q in quiet)


def ignored_reason(key: str, value: Any) -> str | None:
    """None when `key` is not an ignored TRL key; "" when it is and its value asks for nothing (TRL's default);
    else the reason, for the one note line."""
    entry = _ALL.get(key)
    if entry is None:
        return None
    quiet, reason = entry
    return "" if _asks_nothing(value, quiet) else reason
