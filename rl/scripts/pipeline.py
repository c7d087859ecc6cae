"""The README's main job: build a model, SFT it on arithmetic, measure held-out exact-match accuracy,
improve it with GRPO on the math environment, measure again; print both numbers, write the plots.

    python launch/pipeline.py --config recipes/tiny/pipeline.yaml          # ~3 minutes on 2 CPU cores
    python launch/pipeline.py --config recipes/tiny/pipeline.yaml grpo.max_steps=40 overwrite=true   # replaces the run
    python launch/pipeline.py --help
    OMP_NUM_THREADS=1 python launch/pipeline.py --config recipes/tiny/tool_pipeline.yaml   # tool use

With env_type=tool_math (rl.envs.tool_math) the SFT teacher calls the calculator on tool_fraction of its
examples and GRPO trains on multi-turn episodes; the summary then adds the tool-call rates.

Stages write under output_dir: model-init/ (the tiny model), sft/ (SFT run and model), grpo/ (GRPO run
and final model), each with metrics.jsonl and metrics.png; summary.json and accuracy.png hold the
before/after numbers. A rerun into a previous run's output_dir is refused unless overwrite=true; a stage
stopped by SIGINT/SIGTERM ends the pipeline (exit 128 + signal, no summary), and `sft.resume=auto` or
`grpo.resume=auto` continues it. Held-out accuracy is greedy decoding on the math environment's test split
(problems never seen in SFT or GRPO), with the answer extracted and compared by rl.rewards.answers.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Literal

from rl.config.fields import build, opt
from rl.config.parse import save_config
from rl.data.sft import tokenize_examples
from rl.engine.dist import run_as_program
from rl.engine.state import previous_run
from rl.envs.math import create_math_problem_env
from rl.envs.tool_math import create_tool_math_env
from rl.errors import (
    ConfigError,
    DataError,
    RunError,
)
from rl.models.card import write_model_card
from rl.models.limits import check_length
from rl.models.tiny import FAMILIES, write_tiny_model
from rl.scripts.common import fail, final_save, parse_cli, preflight, run_training
from rl.scripts.dryrun import dry_run_report, load_model_config
from rl.trainers.base import check_output_dir
from rl.trainers.grpo import GRPOTrainer
from rl.trainers.grpo_config import GRPOConfig
from rl.trainers.sft import SFTConfig, SFTTrainer


@dataclasses.dataclass
class PipelineConfig:
    output_dir: str = opt("runs/tiny-pipeline", "root of the stages' outputs")
    seed: int = opt(0, "seed of the model initialisation, the data and both trainers")
    model_name: str | None = opt(None, "start from this model (HF id or path); null builds a tiny model")
    tiny_family: str = opt("llama", "family of the tiny model built when model_name is null")
    tiny_hidden: int = opt(64, "hidden size of the tiny model")
    tiny_layers: int = opt(2, "layers of the tiny model")
    tiny_head_dim: int | None = opt(None, "dimensions per attention head of the tiny model (4 heads); null: "
                                    "tiny_hidden / 4, or 64 with use_vllm (vLLM's CPU attention refuses 16)")
    use_vllm: bool = opt(False, "the GRPO stage samples with vLLM (colocated; grpo.vllm_* keys for more)")
    env_config: dict = opt({"problems_path": "data/tiny/math_train.jsonl"},
                           "training math environment (rl.environments.create_math_problem_env keyword "
                           "arguments): the SFT examples and GRPO prompts come from it")
    eval_env_config: dict = opt({"problems_path": "data/tiny/math_test.jsonl"},
                                "held-out environment: keys that replace env_config's (a disjoint problem file, "
                                "or {split: test} for generated problems with {split: train} above)")
    env_type: Literal["math", "tool_math"] = opt("math", "math (answer directly) or tool_math (rl.envs.tool_math: "
                                                 "the policy may call a calculator, multi-turn episodes)")
    tool_fraction: float = opt(0.3, "tool_math: fraction of SFT examples the teacher solves with the calculator")
    num_sft_examples: int = opt(512, "SFT examples drawn from the train split (reference completions)")
    teacher_error_rate: float = opt(0.0, "fraction of SFT answers replaced by answer + 1: a deliberately "
                                    "imperfect teacher whose systematic mistake the verifiable reward corrects")
    eval_num_prompts: int = opt(200, "held-out problems evaluated at most (duplicates removed)")
    skip_sft: bool = opt(False, "start GRPO from model_name itself (an instruct model that already answers)")
    chat_template: bool = opt(False, "chat models: SFT examples become user/assistant messages and GRPO renders "
                              "its prompts with the tokenizer's chat template")
    min_improvement: float | None = opt(None, "exit with status 1 unless accuracy rises by at least this "
                                        "(absolute, e.g. 0.15); for CI")
    sft: dict = opt({}, "SFTConfig keys for the SFT stage (see launch/sft.py --help)")
    grpo: dict = opt({}, "GRPOConfig keys for the GRPO stage (see launch/grpo.py --help)")
    report_to: list[str] = opt(["jsonl"], "metric sinks of both stages: jsonl, wandb")
    quiet: bool = opt(False, "no console line per logging step in either stage (--quiet)")
    dry_run: bool = opt(False, "print each stage's resolved config, sizes and memory plan, then exit without training")
    overwrite: bool = opt(False, "replace a previous run in output_dir (its summary, plots and both stages); without "
                          "it such a rerun is refused, as every trainer refuses one")

    NESTED_SCHEMAS = {"sft": SFTConfig, "grpo": GRPOConfig}  # their keys' other names become theirs before the merge


def stage_configs(cfg: PipelineConfig, init_model: str, sft_dir: Path, grpo_dir: Path):
    env = {"seed": cfg.seed, **cfg.env_config}
    # the pipeline's overwrite is its stages' (each then clears its own metrics and checkpoints)
    sft = build(SFTConfig, {"seed": cfg.seed, "report_to": cfg.report_to, "overwrite": cfg.overwrite, "quiet": cfg.quiet,
                            **cfg.sft,
                            "model_name": init_model, "output_dir": str(sft_dir)}, where="sft")
    grpo = build(GRPOConfig, {"seed": cfg.seed, "report_to": cfg.report_to, "overwrite": cfg.overwrite,
                              "quiet": cfg.quiet, "chat_template": cfg.chat_template,
                              **({"use_vllm": True} if cfg.use_vllm else {}), **cfg.grpo,
                              "model_name": init_model if cfg.skip_sft else str(sft_dir),
                              "output_dir": str(grpo_dir), "env_type": cfg.env_type,
                              "env_config": env, "eval_env_config": cfg.eval_env_config,
                              "eval_num_prompts": cfg.eval_num_prompts},
                 where="grpo")
    return sft, grpo


RESULTS = ("summary.json", "accuracy.png")  # what only a finished pipeline writes


def check_pipeline_output_dir(cfg: PipelineConfig, stages: dict) -> None:
    """Refuse a new pipeline run over a previous one (its summary or a stage's run; a stage given
    `<stage>.resume` continues its own) unless overwrite=true, which removes the old summary and plots
    first: a run stopped later must not leave the previous run's figures beside its own stages."""
    out = Path(cfg.output_dir)
    found = [name for name in RESULTS if (out / name).exists()]
    found += [f"{name}/{previous_run(s.output_dir)}" for name, s in stages.items()
              if not s.resume and previous_run(s.output_dir)]
    if not found:
        return
    if not cfg.overwrite:
        raise RunError(f"output_dir={out} holds a previous pipeline run ({found[0]}); pass overwrite=true to replace "
                       f"it, or another output_dir")
    for name in RESULTS:
        (out / name).unlink(missing_ok=True)


def run_stage(stage: str, trainer, out: Path, later: str | None, *args) -> list[dict]:
    """`trainer.train(*args)` through `run_training` (one `error:` line for a failure). A stage stopped by a
    signal ends the pipeline with 128 + signal, as the launch scripts do: the next stage would train on a
    half-trained model and the summary would report it as the result."""
    try:
        return run_training(trainer, trainer.train, *args)
    except SystemExit:
        if trainer.stopped_by and trainer.accelerator.is_main_process:  # every rank stops; one line says so
            later = f"{later} not run, " if later else ""
            print(f"pipeline: the {stage} stage stopped on signal {trainer.stopped_by} (checkpoint in "
                  f"{out / stage / 'checkpoints'}); {later}summary.json not written; continue with "
                  f"{stage}.resume=auto, or start again with overwrite=true", file=sys.stderr)
        raise


def saved_model(directory: str) -> bool:
    """Whether a finished stage's model (or LoRA adapter) is in `directory` (checkpoints are below it)."""
    return any(Path(directory).glob("*.safetensors"))


def logged_history(run_dir: Path, history: list[dict]) -> list[dict]:
    """A resumed stage's whole history from its metrics.jsonl (the rows before the stop included; the
    last row of a step logged twice wins), so that its step-0 evaluation, the SFT model's accuracy, is
    the summary's "before"; `history` (this run's rows only) when the file is not there."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return history
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return [rows[k] for k in sorted(rows)]


def sloppy_teacher(records: list[dict], error_rate: float, seed: int) -> list[dict]:
    """Replace a seeded `error_rate` fraction of integer answers by answer + 1 (an off-by-one teacher).

    SFT imitates the teacher, mistakes included; GRPO's reward checks the true answer, so it can do
    better than the data it started from. That is the point the tiny pipeline demonstrates."""
    import random

    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"teacher_error_rate must be in [0, 1], got {error_rate}")
    rng = random.Random(seed + 7)
    out = []
    for r in records:
        c = r["completion"]
        if error_rate and c.lstrip("-").isdigit() and rng.random() < error_rate:
            c = str(int(c) + 1)
        out.append({**r, "completion": c})
    return out


def plot_accuracy(history: list[dict], before: float, after: float, path: Path, start: str = "SFT") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["step"], r["eval/accuracy"]) for r in history if "eval/accuracy" in r]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title(f"{start} {100 * before:.1f}% -> GRPO {100 * after:.1f}%", fontsize=10)  # start: no SFT stage
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    # 1. parse: every stage's config is built (and validated) before anything runs
    cfg = parse_cli(PipelineConfig, argv, prog="launch/pipeline.py", description=__doc__)
    preflight(cfg)  # model names, deepspeed file, resume path, output_dir: before any model
    if cfg.model_name is None and cfg.tiny_family not in FAMILIES:
        fail(f"key 'tiny_family': unknown family {cfg.tiny_family!r}; use one of {', '.join(FAMILIES)}")
    out = Path(cfg.output_dir)
    t0 = time.time()
    try:
        init_model = cfg.model_name or str(out / "model-init")
        sft_cfg, grpo_cfg = stage_configs(cfg, init_model, out / "sft", out / "grpo")
        if cfg.env_type == "tool_math":  # a teacher that calls the calculator on tool_fraction of the problems
            env = create_tool_math_env(None, **{"seed": cfg.seed, **cfg.env_config})
            sft_rows = env.sft_records(cfg.num_sft_examples, seed=cfg.seed + 1, tool_fraction=cfg.tool_fraction)
        else:
            env = create_math_problem_env(None, **{"seed": cfg.seed, **cfg.env_config})
            sft_rows = env.sft_records(cfg.num_sft_examples, seed=cfg.seed + 1)
        records = sloppy_teacher(sft_rows, cfg.teacher_error_rate, cfg.seed)
    except (ConfigError, DataError, ValueError, TypeError) as e:
        fail(str(e))
    if cfg.dry_run:  # each stage's plan; the SFT model GRPO starts from is the one SFT starts from
        plan_model = cfg.model_name or f"tiny:{cfg.tiny_family}"
        for name, stage in (("sft", sft_cfg), ("grpo", grpo_cfg)):
            if name == "sft" and cfg.skip_sft:
                continue
            print(f"# stage {name}")
            models = (GRPOTrainer.dry_run_models(dataclasses.replace(stage, model_name=plan_model)) if name == "grpo"
                      else {"policy (trainable)": plan_model})
            try:
                dry_run_report(stage, n_examples=len(records) if name == "sft" else None, models=models)
            except ConfigError as e:
                fail(f"{name} stage: {e}")
        return
    # a resumed GRPO stage continues from the finished SFT stage's model: SFT is not run again
    run_sft = not cfg.skip_sft and not (grpo_cfg.resume and saved_model(sft_cfg.output_dir))
    try:
        check_pipeline_output_dir(cfg, {"sft": sft_cfg, "grpo": grpo_cfg} if run_sft else {"grpo": grpo_cfg})
        for stage in (sft_cfg, grpo_cfg) if run_sft else (grpo_cfg,):
            check_output_dir(stage)
    except RunError as e:
        fail(str(e))
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out, "pipeline.yaml")
    # 2. model
    if cfg.model_name is None:
        head_dim = cfg.tiny_head_dim or (64 if grpo_cfg.use_vllm else None)
        write_tiny_model(init_model, family=cfg.tiny_family, hidden=cfg.tiny_hidden, layers=cfg.tiny_layers,
                         seed=cfg.seed, head_dim=head_dim)
    # both stages' lengths against the model's context now: GRPO's trainer would find its own only after SFT
    conf = load_model_config(init_model, sft_cfg.trust_remote_code)
    try:
        for name, stage in (("sft", sft_cfg), ("grpo", grpo_cfg)):
            if conf is not None:
                check_length(stage.max_length, conf, init_model, key=f"{name}.max_length")
    except ConfigError as e:
        fail(str(e))
    # 3. SFT on the train split's reference answers
    if cfg.chat_template:
        records = [{"messages": [{"role": "user", "content": r["prompt"]},
                                 {"role": "assistant", "content": r["completion"]}]} for r in records]
    if run_sft:
        try:
            sft = SFTTrainer(sft_cfg)
            data = tokenize_examples(records, sft.tokenizer, sft_cfg, "math environment (train split)")
        except (ConfigError, DataError, RunError) as e:
            fail(str(e))
        sft_history = run_stage("sft", sft, out, "grpo", data)
        with final_save(sft_cfg.output_dir):  # a full disk: one line, as in the standalone scripts
            sft.save()
            if sft.accelerator.is_main_process:
                write_model_card(sft_cfg.output_dir, sft_cfg, sft_history, "sft")
    t_sft = time.time() - t0
    # 4. GRPO on the math environment; it evaluates the held-out split before its first step (= the SFT
    #    model's accuracy) and after its last one
    try:
        grpo = GRPOTrainer(grpo_cfg)
    except (ConfigError, DataError, RunError) as e:
        fail(str(e))
    history = run_stage("grpo", grpo, out, None)
    with final_save(grpo_cfg.output_dir):
        grpo.save()
        if grpo.accelerator.is_main_process:
            write_model_card(grpo_cfg.output_dir, grpo_cfg, history, "grpo")
    if grpo_cfg.resume:
        history = logged_history(Path(grpo_cfg.output_dir), history)
    evals = [r for r in history if "eval/accuracy" in r]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    if grpo.accelerator.is_main_process:
        # tool_math: the held-out greedy tool-call rate, and the sampled one of the first and last step's episodes
        sampled = [r["rewards/tool_use/mean"] for r in history if "rewards/tool_use/mean" in r]
        tools = {k: evals[i]["eval/tool_call_rate"] for k, i in (("sft_tool_call_rate", 0), ("grpo_tool_call_rate", -1))
                 if "eval/tool_call_rate" in evals[i]}
        if sampled:
            tools.update(first_step_sampled_tool_call_rate=sampled[0], last_step_sampled_tool_call_rate=sampled[-1])
        # rounded as measured: accuracies are counts over eval_problems (0.45, not 0.45000000000000007)
        summary = {"sft_accuracy": round(before, 6), "grpo_accuracy": round(after, 6),
                   "improvement": round(after - before, 6), **{k: round(v, 6) for k, v in tools.items()},
                   "eval_problems": evals[0]["eval/num_prompts"],
                   "sft_steps": 0 if cfg.skip_sft else sft_cfg.max_steps,
                   "grpo_steps": grpo_cfg.max_steps, "seconds": round(time.time() - t0, 1),
                   "seconds_sft": round(t_sft, 1), "models": {**({} if cfg.skip_sft else {"sft": str(out / "sft")}), "grpo": str(out / "grpo")}}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        start = "start" if cfg.skip_sft else "SFT"
        plot_accuracy(history, before, after, out / "accuracy.png", start)
        print(f"held-out exact match ({summary['eval_problems']} problems): {start} {100 * before:.1f}% -> "
              f"GRPO {100 * after:.1f}% ({100 * (after - before):+.1f} points) in {summary['seconds']:.0f} s; "
              f"plots: {out}/accuracy.png, {'' if cfg.skip_sft else f'{out}/sft/metrics.png, '}{out}/grpo/metrics.png")
        if tools:
            print(f"tool-call rate: held-out greedy {start} {100 * tools['sft_tool_call_rate']:.1f}% -> GRPO "
                  f"{100 * tools['grpo_tool_call_rate']:.1f}%; sampled, first -> last GRPO step "
                  f"{100 * tools['first_step_sampled_tool_call_rate']:.1f}% -> "
                  f"{100 * tools['last_step_sampled_tool_call_rate']:.1f}%")
    if cfg.min_improvement is not None and after - before < cfg.min_improvement:
        print(f"error: accuracy rose by {after - before:.3f}, less than min_improvement={cfg.min_improvement}",
              file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    run_as_program(main)
