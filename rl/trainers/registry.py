"""Every trainer, registered once: `TRAINERS` below is what the launch code reads (`rl.scripts.train.main`, the
`launch/<name>.py` shims, `rl-train --trainer`, `--dry-run`), what `rl/__init__.py` exports, what the docs table
(`docs/trainers.md`) shows and what the lifecycle and failure tests run.

A new trainer is its file in rl/trainers/, a tiny recipe `recipes/tiny/<name>.yaml` and one `Entry(...)` here;
tests/unit/test_registry.py says what else is missing (the launch shim: a copy of any other launch/<name>.py).

This module is pure data and small pure functions (no torch, no trainer import): classes are named as
"module:Class" and imported only when a run needs them (`resolve`), so `import rl` stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields

NAN = float("nan")


# ---------------------------------------------------------------------------- the summary lines
# Each takes (history, plan, trainer): the run's metric rows (the reward trainer: its final metrics), the plan
# the trainer made, the trainer; it returns the middle of "<name> done: ...; model saved to <out>", or None for
# no line at all (a run that logged no row).

def loss_summary(history, plan, trainer) -> str | None:
    if not history:
        return None
    return f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} over {len(history)} steps"


def dpo_summary(history, plan, trainer) -> str | None:
    if not history:
        return None
    first, last = history[0], history[-1]
    acc = last.get("eval/rewards/accuracies", last["rewards/accuracies"])
    return f"loss {first['loss']:.4f} -> {last['loss']:.4f}, reward accuracy {acc:.3f} over {len(history)} steps"


def kto_summary(history, plan, trainer) -> str | None:
    if not history:
        return None
    first, last = history[0], history[-1]
    margin = last.get("eval/rewards/margins", last.get("rewards/margins", NAN))
    return f"loss {first['loss']:.4f} -> {last['loss']:.4f}, reward margin {margin:.3f} over {len(history)} steps"


def reward_summary(metrics, plan, trainer) -> str:
    first = trainer.history[0]["loss"] if trainer.history else NAN
    ev = f", eval accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""
    return (f"loss {first:.4f} -> {metrics.get('loss', NAN):.4f}, accuracy {metrics.get('accuracy', NAN):.3f}{ev} "
            f"over {trainer.current_step} steps")


def _first_last(rows, key: str, fmt: str = ".3f") -> str:
    return f"{rows[0][key]:{fmt}} -> {rows[-1][key]:{fmt}}"


def _online_line(history, plan, key: str, label: str, more=lambda rows: "") -> str:
    """"N steps; <label> first -> last<more>; eval accuracy first -> last" of an online trainer's rows."""
    train = [r for r in history if key in r]
    evals = [r for r in history if "eval/accuracy" in r]
    msg = f"{plan['total_steps']} steps"
    if train:
        msg += f"; {label} {_first_last(train, key)}{more(train)}"
    if evals:
        msg += f"; eval accuracy {_first_last(evals, 'eval/accuracy')}"
    return msg


def grpo_summary(history, plan, trainer) -> str:
    return _online_line(history, plan, "reward", "reward")


def online_dpo_summary(history, plan, trainer) -> str:
    return _online_line(history, plan, "objective/scores", "scores",
                        lambda rows: f", ties {sum(r['online_dpo/ties'] for r in rows) / len(rows):.2f}")


def distill_summary(history, plan, trainer) -> str:
    rows = [r for r in history if "loss" in r]
    msg = f"{plan['total_steps']} steps"
    if rows:
        msg += f"; loss {_first_last(rows, 'loss', '.4f')}, on-policy steps {sum(r['on_policy'] for r in rows):.0f}/{len(rows)}"
    return msg


def ppo_summary(history, plan, trainer) -> str | None:
    if not history:
        return None
    first, last = history[0], history[-1]
    return (f"objective/scores {first['objective/scores']:.4f} -> {last['objective/scores']:.4f}, objective/kl "
            f"{last['objective/kl']:.4f}, kl_coef {last['kl_coef']:.4f} over {last['iteration']} iterations "
            f"({len(history)} optimizer steps); seconds: generation {last['time/generation']:.2f} and scoring "
            f"{last['time/scoring']:.2f} per iteration, training {last['time/training']:.2f} per step")


# ------------------------------------------------------------------------------------------ the data keys

SOURCE_KEYS = ("path", "name", "split", "max_examples", "streaming", "mixture")  # every trainer reads these
HELD_OUT = ("eval_path", "eval_split", "eval_fraction")  # an evaluation on data (the online trainers use environments)


def unread_data_key(entry: "Entry", data) -> str | None:
    """The first data.* key set (to other than its default) that `entry`'s trainer does not read, as one line, or
    None: a key without effect is refused (PPO's prompts are data.text_column, not data.prompt_column; GRPO
    evaluates through eval_env_config, not data.eval_path)."""
    for f in fields(data):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if f.name in SOURCE_KEYS or f.name in entry.data_keys or getattr(data, f.name) == default:
            continue
        columns = [f"data.{k}" for k in entry.data_keys if k.endswith("_column")]
        if f.name.endswith("_column"):
            hint = f" (its columns: {', '.join(columns)})" if columns else ""
            fix = f", or set {columns[0]}={getattr(data, f.name)}" if len(columns) == 1 else ""
        else:
            hint = (" (its held-out data is data.eval_path)" if "eval_path" in entry.data_keys else
                    " (it evaluates with an environment's eval_env_config)" if entry.name in ("grpo", "online_dpo")
                    else "")
            fix = ""
        return f"key 'data.{f.name}' has no effect in the {entry.name} trainer{hint}; drop it{fix}"
    return None


# ------------------------------------------------------------------------------------------ the entry

# How rl.scripts.train.main drives a trainer between parsing and saving (its SHAPES):
#   "epoch"  XTrainer.load_data(cfg) -> (rows, eval rows); XTrainer(cfg); `dataset`.from_records; plan(n); train(ds, eval)
#   "online" XTrainer.load_data(cfg) -> prompt rows or None; XTrainer(cfg, train_prompts=rows); plan(); train()
#   "sft", "reward", "ppo": the shapes of those three trainers alone
SHAPE_NAMES = ("epoch", "online", "sft", "reward", "ppo")


@dataclass(frozen=True)
class Entry:
    name: str                       # launch/<name>.py, rl-train --trainer <name>, recipes/tiny/<name>.yaml
    title: str                      # the docs table's first column
    config: str                     # "module:Class" of its schema
    trainer: str                    # "module:Class" of its trainer
    shape: str                      # one of SHAPE_NAMES
    summary: Callable               # the final line's middle (see above)
    require_data: bool = True       # a missing data.path is an error (else an environment may supply prompts)
    dataset: str | None = None      # "epoch": "module:Class" with .from_records(rows, tokenizer, cfg, path)
    plan: str | None = None         # --dry-run: "module:function"(cfg, world=, n_prompts=) -> the trainer's own sizes
    prompt_group: int | str | None = None  # --dry-run: distinct prompts per completion group (a config key's value)
    text_column: str | None = None  # the key rl-train's --text-column sets (None: the flag has no meaning)
    short_run: tuple[str, ...] = field(default=())  # overrides: {n} optimizer steps of a few examples (tests, smoke)
    data_keys: tuple[str, ...] = ()  # the data.* keys it reads besides SOURCE_KEYS (any other set one: refused)

    @property
    def doc(self) -> str:
        """`--help`'s description: what it is, the commands, the data it reads (HELP below)."""
        return _usage(self.name)


# `--help`'s description of each trainer: (what it is, the data it reads, commands beyond the common ones)
HELP: dict[str, tuple[str, str, str]] = {
    "sft": ("Supervised fine-tuning.", "", ""),
    "reward": (
        "Reward-model training on preference pairs (step 1 of RLHF; PPO/GRPO load the result by path).",
        "Data: JSONL (or JSON/CSV/Parquet) rows {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}; the reference\n"
        "CLI's --prompt-text-column / --text-column / --rejected-text-column rename the columns. The model is\n"
        "written to output_dir (safetensors + reward_config.json): `rl.models.reward.load_reward_model(output_dir)`.",
        ""),
    "dpo": (
        "DPO-family preference training (DPO, conservative DPO, IPO, hinge, reference-free, ORPO).",
        "Data: one pair per row, {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...} (column names under data.*), as\n"
        "strings or as lists of {\"role\", \"content\"} chat messages (rendered with the tokenizer's chat template).",
        "    python launch/dpo.py --config recipes/tiny/dpo.yaml loss_type=ipo precompute_ref_logps=true\n"),
    "ppo": (
        "PPO for RLHF (step 2 of the reference's pipeline: train a reward model with launch/reward.py, then this).",
        "Data: prompts only, JSONL (or JSON/CSV/Parquet) rows {\"text\": \"...\"} (data.text_column); other columns\n"
        "(e.g. \"answer\") are passed to the reward as metadata. Reward: reward_model_path (--rl-reward-model-path),\n"
        "reward_fn (--rl-reward-fn default|length_penalty|correctness|custom) or an environment (--rl-env-type,\n"
        "--rl-env-config); several combine when reward_weights (--rl-reward-weights) is given. A reward source on\n"
        "the command line replaces the recipe's. With only ref_model (--model-ref) reward_fn=default is used; with\n"
        "none the run stops at once. An environment may also supply the prompts when data.path is not set.\n"
        "(rl_* names are aliases.)",
        "    accelerate launch launch/ppo.py --config recipes/gemma.yaml\n"),
    "grpo": ("GRPO / Dr. GRPO / RLOO / REINFORCE++ fine-tuning with reward functions or an environment.", "", ""),
    "online_dpo": (
        "Online DPO (Guo et al. 2024): two samples per prompt, ranked by reward functions, a reward model or an\n"
        "environment, and a DPO / IPO / hinge step on each fresh pair against the frozen reference.", "", ""),
    "kto": (
        "KTO: preference training on unpaired rows (a completion labelled desirable or not).",
        "Data: one row per completion, {\"prompt\": ..., \"completion\": ..., \"label\": true|false} (column names under\n"
        "data.*: prompt_column, completion_column, label_column), strings or lists of {\"role\", \"content\"} messages.",
        "    python launch/kto.py --config recipes/tiny/kto.yaml beta=0.2 undesirable_weight=1.2\n"),
    "distill": (
        "On-policy distillation (GKD, Agarwal et al. 2024): a student matches a frozen teacher's next-token\n"
        "distributions (generalised JSD) on the data's completions or, with probability lmbda per step, on its own\n"
        "samples.",
        "Data: rows {\"prompt\": ..., \"completion\": ...} (column names under data.*: prompt_column, completion_column).",
        "    python launch/distill.py --config recipes/tiny/distill.yaml lmbda=1.0 beta=1.0\n"),
}
NO_ZERO3 = {"distill"}  # 2 processes under ZeRO-3 not yet tested: the help shows plain data parallel


def _usage(name: str) -> str:
    """HELP[name]: what it is, the commands every launch script takes, its own commands, the data it reads."""
    what, data, extra = HELP[name]
    two = "" if name in NO_ZERO3 else "--use_deepspeed --deepspeed_config_file ds_configs/zero3.json \\\n        "
    cmds = (f"    python launch/{name}.py --config recipes/tiny/{name}.yaml\n"
            f"    accelerate launch --num_processes 2 {two}launch/{name}.py --config recipes/tiny/{name}.yaml\n{extra}"
            f"    python launch/{name}.py --help        # every key, its default and meaning")
    return f"{what}\n\n{cmds}\n" + (f"\n{data}\n" if data else "")


TRAINERS: dict[str, Entry] = {e.name: e for e in (
    Entry("sft", "SFT (completion-only loss, LoRA)", "rl.trainers.sft:SFTConfig", "rl.trainers.sft:SFTTrainer",
          "sft", loss_summary, text_column="data.text_column", short_run=("per_device_train_batch_size=4", "max_steps={n}"),
          data_keys=(*HELD_OUT, "text_column", "prompt_column", "completion_column", "messages_column", "strict")),
    Entry("reward", "reward model (BT, pairwise, multi-objective, QLoRA)", "rl.trainers.reward_config:RewardTrainConfig",
          "rl.trainers.reward:RewardModelTrainer", "reward", reward_summary, text_column="data.chosen_column",
          short_run=("per_device_train_batch_size=4", "num_train_epochs=100", "max_steps={n}", "data.eval_fraction=0"),
          data_keys=(*HELD_OUT, "prompt_column", "chosen_column", "rejected_column")),
    Entry("dpo", "DPO family (sigmoid, IPO, hinge, cDPO, reference-free, ORPO, SimPO)", "rl.trainers.dpo:DPOConfig",
          "rl.trainers.dpo:DPOTrainer", "epoch", dpo_summary, dataset="rl.data.preference:PreferenceDataset",
          text_column="data.chosen_column",
          short_run=("per_device_train_batch_size=4", "max_steps={n}", "eval_steps=0", "data.eval_fraction=0"),
          data_keys=(*HELD_OUT, "prompt_column", "chosen_column", "rejected_column")),
    Entry("ppo", "PPO (value head or critic, adaptive KL, GAE)", "rl.trainers.ppo_config:PPOConfig",
          "rl.trainers.ppo:PPOTrainer", "ppo", ppo_summary, require_data=False, plan="rl.trainers.ppo_config:ppo_plan",
          text_column="data.text_column", short_run=("per_device_train_batch_size=4", "mini_batch_size=4", "gradient_accumulation_steps=1",
                                                     "num_ppo_epochs=1", "max_completion_length=4", "max_steps={n}"),
          data_keys=("eval_path", "eval_split", "text_column")),
    Entry("grpo", "GRPO family (GRPO, Dr. GRPO, RLOO, REINFORCE++, DAPO, GSPO)", "rl.trainers.grpo_config:GRPOConfig",
          "rl.trainers.grpo:GRPOTrainer", "online", grpo_summary, require_data=False,
          plan="rl.trainers.grpo_config:grpo_sizes", prompt_group="num_generations", text_column="data.text_column",
          short_run=("per_device_train_batch_size=8", "num_generations=4", "max_steps={n}", "eval_steps=0", "eval_num_prompts=4"),
          data_keys=("prompt_column", "text_column")),
    Entry("online_dpo", "online DPO (two samples ranked by the reward sources; sigmoid, IPO, hinge)",
          "rl.trainers.online_dpo:OnlineDPOConfig", "rl.trainers.online_dpo:OnlineDPOTrainer", "online",
          online_dpo_summary, require_data=False, prompt_group=1, text_column="data.text_column",
          short_run=("per_device_train_batch_size=4", "max_steps={n}", "max_completion_length=4"),
          data_keys=("prompt_column", "text_column")),
    Entry("kto", "KTO (unpaired rows `prompt`/`completion`/`label`, KL reference point from mismatched rows, "
          "desirable/undesirable weights)", "rl.trainers.kto:KTOConfig", "rl.trainers.kto:KTOTrainer", "epoch",
          kto_summary, dataset="rl.data.kto:UnpairedDataset", text_column="data.completion_column",
          short_run=("per_device_train_batch_size=4", "max_steps={n}", "eval_steps=0", "data.eval_fraction=0"),
          data_keys=(*HELD_OUT, "prompt_column", "completion_column", "label_column")),
    Entry("distill", "on-policy distillation (GKD: a frozen teacher, generalised JSD `beta`, the student's own "
          "samples with probability `lmbda`, `seq_kd`)", "rl.trainers.distill:DistillConfig",
          "rl.trainers.distill:DistillTrainer", "online", distill_summary, prompt_group=1,
          text_column="data.completion_column",
          short_run=("per_device_train_batch_size=4", "gradient_accumulation_steps=1", "max_steps={n}", "max_completion_length=4"),
          data_keys=("prompt_column", "text_column", "completion_column")),
)}


def entry(name: str) -> Entry:
    """The registered trainer `name`; a KeyError names the choices."""
    if name not in TRAINERS:
        raise KeyError(f"no trainer {name!r}; registered: {', '.join(TRAINERS)}")
    return TRAINERS[name]


def resolve(ref: str):
    """The object a "module:name" reference names (imports the module)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def exports() -> dict[str, str]:
    """Public name -> module of every registered config and trainer class (rl/__init__.py's per-trainer names)."""
    out = {}
    for e in TRAINERS.values():
        for ref in (e.config, e.trainer):
            module, _, name = ref.partition(":")
            out[name] = module
    return out


def docs_table() -> str:
    """The Markdown table of the registered trainers (docs/trainers.md holds it; a test compares)."""
    rows = [f"| {e.title} | `launch/{e.name}.py` | `rl-train --trainer {e.name}` | `recipes/tiny/{e.name}.yaml` | "
            f"`rl.{e.trainer.split(':')[1]}`, `rl.{e.config.split(':')[1]}` |" for e in TRAINERS.values()]
    return "\n".join(["| trainer | launch script | CLI | tiny recipe (CPU) | Python API |",
                      "| --- | --- | --- | --- | --- |", *rows])
