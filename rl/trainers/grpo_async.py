"""GRPO's asynchronous rollouts (`max_staleness`, `rollout_processes`; docs/rollout.md): where the batch of each
step comes from, and the loss of a batch sampled by an older policy.

The batch of step t is sampled by the policy of version max(start, t - k) (`rl.rollout.staleness`), by one of:
* this process, k steps ahead of the step that trains (`rl.rollout.ahead.InProcess`: our sampler or a colocated
  vLLM engine; the same samples a rollout process would give, deterministic, no overlap on one device);
* a vLLM server while this process trains (`use_vllm=true vllm_mode=server`, `rl.rollout.ahead.ServerAhead`);
* rollout processes of the launch (`rollout_processes=N`, `rl.rollout.channel`).
This module hands them `sample(index, version)` and reads nothing of theirs but the batches.

The loss: a batch of staleness s > 0 carries the log-probs its sampler recorded for its tokens (ours, or vLLM's)
as the behaviour policy, and is corrected by `off_policy_correction` (`rl.algos.off_policy`): `behaviour`, TRL's
AsyncGRPO (the behaviour log-probs are the old policy of the clipped ratio), or `decoupled`, AReaL's decoupled
PPO (the clip anchored at the current weights, the behaviour weight pi_current / pi_behaviour capped). A batch
of staleness 0 was sampled by the very weights that train on it: it keeps the synchronous loss (old policy =
current, detached; with vLLM the mismatch correction of vllm_importance_sampling_*), so k = 0 through this path
equals the plain loop bit for bit.
"""

from __future__ import annotations

import time

from accelerate.utils import broadcast_object_list

from rl.engine import segments
from rl.engine.dist import zero_stage
from rl.engine.generation import _resolve_ids, generate
from rl.engine.pipeline import ForwardBackwardPipeline
from rl.engine.state import PER_PROCESS
from rl.errors import ConfigError
from rl.rollout.ahead import InProcess, ServerAhead
from rl.rollout.channel import TrainerEnd, serve_rollouts, split_world
from rl.rollout.staleness import StalenessBuffer, Tagged, staleness_metrics
from rl.rollout.vllm_batching import local_only
from rl.rollout.vllm_engine import request_of, sampling_params, to_rollout
from rl.trainers.grpo_batch import select_rollout
from rl.trainers.sampling import rollout_sampler


class AsyncRollouts:
    """Mixed into GRPOTrainer: the buffered generation batches, their checkpoint part, and the step's batch."""

    _buffer: StalenessBuffer | None = None
    _start_version = 0  # the first version this process's run has weights of (0, or the resumed step)
    _channel: TrainerEnd | None = None  # on a training process with rollout_processes
    _role = None  # rl.rollout.channel.Role with rollout_processes
    _producer = None  # InProcess or ServerAhead (rollout_processes=0)

    def async_setup(self, cfg) -> None:
        """Before the accelerator: this process's side of the launch (rollout_processes)."""
        self._role = split_world(cfg.rollout_processes)

    def async_built(self) -> None:
        """After the accelerator and the policy: the training side's channel, or the rollout side's marks."""
        cfg = self.cfg
        if self.server_ahead and (cfg.dynamic_sampling or getattr(self.env, "multi_turn", False)):
            raise ConfigError("max_staleness with vllm_mode=server samples each step's prompts ahead in one request: "
                              "dynamic_sampling and multi-turn environments need the rewards first; set "
                              "max_staleness=0, or use_vllm=false (our sampler samples them ahead in this process)")
        if self._role is None:
            return
        if not self._role.rollout:
            if zero_stage(self.accelerator) == 3:
                raise ConfigError("rollout_processes does not support ZeRO-3 yet (a rollout process holds whole "
                                  "weights): use DDP or ZeRO-2, or rollout_processes=0")
            self._channel = TrainerEnd(self._role, cfg.max_staleness)
        else:  # a 1-process world of its own: not the run's main process (no files, no final line)
            self.accelerator = _RolloutSide(self.accelerator)

    @property
    def is_rollout_process(self) -> bool:
        return self._role is not None and self._role.rollout

    @property
    def server_ahead(self) -> bool:
        """A vLLM server samples ahead while this process trains."""
        cfg = self.cfg
        return bool(cfg.max_staleness and cfg.use_vllm and cfg.vllm_mode == "server" and not cfg.rollout_processes)

    def async_train(self, fit):
        """`fit()` on a training process, the rollout program on a rollout process."""
        if self.is_rollout_process:
            return self._serve_rollouts()
        try:
            history = fit()
        except BaseException:
            if isinstance(self._producer, ServerAhead):  # a request on its way ends with its HTTP timeout
                self._producer.close(wait=False)
            raise
        if isinstance(self._producer, ServerAhead):
            self._producer.close()
        if self._channel is not None:
            self._channel.close()
        return history

    def save(self, out_dir=None):
        if self.is_rollout_process:  # the training processes write the model
            return out_dir or self.cfg.output_dir
        return super().save(out_dir)

    @property
    def buffered(self) -> bool:
        """Whether steps take their batch from the staleness buffer (k > 0, or rollout processes)."""
        return bool(self.cfg.max_staleness or self.cfg.rollout_processes)

    def _buffer_now(self) -> StalenessBuffer:
        if self._buffer is None:
            self._buffer = StalenessBuffer(self.cfg.max_staleness)
        return self._buffer

    def _tag(self, step: int, version: int, gb: dict) -> Tagged:
        return Tagged(step=step, version=version, batch=gb, samples=int(gb["batch"]["input_ids"].shape[0]) * self.world)

    # ------------------------------------------------------------------ where the batches come from
    def _producer_now(self):
        if self._producer is None:
            k = self.cfg.max_staleness
            if self.server_ahead:
                self._producer = ServerAhead(
                    k, sample=self._score_server_rollout, tag=self._tag,
                    request=self._server_request, fetch=self._server_fetch, sync=self._server_sync,
                    share=self._share_from_main, main=self.accelerator.is_main_process)
            else:
                self._producer = InProcess(k, lambda index, version: self._generation_batch(index), self._tag)
        return self._producer

    def _server_sync(self, version: int) -> None:
        """The server holds the weights of `version` (the current policy): pushed when it moved on."""
        rollout_sampler(self, generate)  # builds the engine's client at the first call; syncs the weights

    def _server_request(self, index: int) -> tuple[list, dict]:
        """Every process's prompt ids of generation `index` and the sampler's keywords (the main process)."""
        return [self.round_prompts(index, 0, p)[1] for p in range(self.world)], self.sampling_kwargs(index, 0)

    def _server_fetch(self, request: tuple[list, dict]) -> list:
        """One request to the server for every process's prompts (worker thread, main process): a rollout per
        process. Not the engine's `generate`, which gathers the processes' prompts itself (a collective); the same
        request otherwise (rl.rollout.vllm_engine): row r of the call samples from seed + r, and process p's rows
        follow process p - 1's, so each row gets the seed it has in the synchronous run."""
        per_process, kw = request
        flat = [p for prompts in per_process for p in prompts]
        _, pad, eos = _resolve_ids(self.tokenizer, None)
        sp = sampling_params(kw["num_samples"], kw["max_new_tokens"], kw["temperature"], kw["top_k"], kw["top_p"],
                             [eos] if isinstance(eos, int) else list(eos or []))
        rollout = to_rollout(flat, local_only(request_of(flat, sp, kw["seed"]), self._vllm.client.generate), pad)
        rows = len(per_process[0]) * kw["num_samples"]
        return [select_rollout([rollout], list(range(p * rows, (p + 1) * rows))) for p in range(len(per_process))]

    def _score_server_rollout(self, index: int, version: int, rollout) -> dict:
        """The generation batch of `index` from the server's samples of this process's share."""
        if rollout.prompts[::self.cfg.num_generations] != self.round_prompts(index, 0)[1]:
            raise RuntimeError(f"the server's samples for generation {index} are not of process "
                               f"{self.accelerator.process_index}'s prompts")  # a share dealt to the wrong process
        return self._generation_batch(index, rollout)

    def _share_from_main(self, result):
        if self.world > 1:
            result = broadcast_object_list([result], from_process=0)[0]
        per_step, seconds = result
        return [rollouts[self.accelerator.process_index] for rollouts in per_step], seconds

    def async_generation_batch(self) -> tuple[dict, dict]:
        """This step's generation batch from the buffer (sampled ahead here or by a vLLM server, or received from
        a rollout process), the loss's correction set by its staleness (module docstring), and the step's
        async/* and time/waiting_* metrics."""
        cfg, step = self.cfg, self.pipeline.step
        buf = self._buffer_now()
        t0 = time.time()
        if self._channel is not None:
            if not self._channel.started:
                self._channel.start(step, self._plan["total_steps"], self.pipeline.unwrapped_model)
            version, gb = self._channel.receive(step)
            buf.put(self._tag(step, version, self._received(gb)))
            waited = time.time() - t0
        else:
            producer = self._producer_now()
            producer.fill(buf, step, step, self._start_version, self._plan["total_steps"])
            waited = producer.waited
        item = buf.take(step, step)
        if item is None:  # dropped as too old (or never sampled): the current policy samples it now
            item = self._tag(step, step, self._generation_batch(step))
        gb, loss_kw = item.batch, {}
        if item.version != step:  # sampled by an older policy: the sampler's log-probs are the behaviour ones
            batch = {**gb["batch"], "behaviour": gb["batch"]["old_logprobs"]}
            gb = {**gb, "batch": batch}
            loss_kw = {"off_policy": cfg.off_policy_correction, "behav_imp_weight_cap": cfg.behav_imp_weight_cap}
        metrics = staleness_metrics(item, step, cfg.max_staleness, buf)
        metrics["time/waiting_trainer"] = waited
        if "t_wait" in gb:
            metrics["time/waiting_rollout"] = gb["t_wait"]
        if isinstance(self._producer, ServerAhead):
            metrics["time/weight_sync"] = self._producer.synced
        return {**gb, "loss_kw": loss_kw}, metrics

    def async_after_step(self) -> None:
        """After an optimizer step: the rollout processes get the new weights (version pipeline.step)."""
        if self._channel is not None:
            self._channel.after_step(self.pipeline.unwrapped_model, self.pipeline.step)

    def _received(self, gb: dict) -> dict:
        """A batch from a rollout process on this process's device; with several training processes the token
        count of token_mean and the scalar metrics over all of them (the rollout process saw one share)."""
        dev = self.accelerator.device
        gb = {**gb, "batch": {k: v.to(dev) for k, v in gb["batch"].items()}, "world": self.world}
        if self.world > 1:
            n = self.accelerator.reduce(gb["batch"]["labels"][:, 1:].ne(-100).sum().float(), "sum")
            gb["num_items"] = float(n.clamp(min=1)) / (self.world * self.cfg.gradient_accumulation_steps)
            gb["metrics"] = self.reduce(gb["metrics"])
        return gb

    # ------------------------------------------------------------------ a rollout process's run
    def _serve_rollouts(self) -> list[dict]:
        """This rollout process's program (rl.rollout.channel.serve_rollouts) around `sample(index, version)`:
        the policy in a pipeline without an optimizer, the generation batches GRPO's own."""
        cfg = self.cfg
        self._plan = self.plan()
        self.pipeline = ForwardBackwardPipeline(self._model, accelerator=self.accelerator,
                                                gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                                micro_batch_size=cfg.per_device_train_batch_size,
                                                logprob_chunk_size=cfg.logprob_chunk_size)
        self.reference.place(self.accelerator)
        self._share = cfg.share_prompt_forward and segments.prefix_sharing(self.pipeline.unwrapped_model)

        def sample(index: int, version: int) -> dict:
            self.pipeline.step = version  # the weights loaded are this version's
            return self._generation_batch(index)

        serve_rollouts(self._role, self.pipeline.unwrapped_model, sample, cfg.max_staleness)
        return []

    # ------------------------------------------------------------------ checkpoint part
    def async_checkpoint(self, extra: dict) -> dict:
        """The rollout position (the first step no batch was sampled for) and the drop counts; the batches
        sampled ahead (those on their way from a server first) go per process, so a resume trains on exactly
        them (rollout_processes=0)."""
        if not self.buffered:
            return extra
        buf, step = self._buffer_now(), self.pipeline.step
        if self._producer is not None:
            self._producer.drain(buf)
        extra["async"] = {"next_step": buf.next_step(step), **buf.state()}
        if self._channel is None and buf.items:
            own = extra.setdefault(PER_PROCESS, {})
            own["async_items"] = [vars(i) for i in buf.items]
        return extra

    def async_restore(self, extra: dict) -> None:
        state = extra.get("async")
        self._start_version = self.pipeline.step
        if state is None or not self.buffered:
            return
        items = []
        for it in extra.get(PER_PROCESS, {}).get("async_items", []):
            if it["batch"]["world"] != self.world:
                items = []  # another number of processes splits the batches otherwise: sampled afresh
                break
            dev = self.accelerator.device
            gb = {**it["batch"], "batch": {k: v.to(dev) for k, v in it["batch"]["batch"].items()}}
            items.append(Tagged(**{**it, "batch": gb}))
        # the versions the stored batches were sampled with are older than the resumed weights: kept
        self._start_version = min([self.pipeline.step] + [i.version for i in items])
        self._buffer_now().load(state, items)


class _RolloutSide:
    """A rollout process's accelerator: its own, except that it is never the run's main process."""

    is_main_process = False
    is_local_main_process = False

    def __init__(self, acc):
        self._acc = acc

    def __getattr__(self, name):
        return getattr(self._acc, name)
