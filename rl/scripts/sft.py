"""Supervised fine-tuning.

    python launch/sft.py --config recipes/tiny/sft.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \\
        launch/sft.py --config recipes/tiny/sft.yaml
    python launch/sft.py --help        # every key, its default and meaning
"""

from __future__ import annotations

from rl.config.parse import cli_config
from rl.data.records import (
    has_data,
    split_eval,
)
from rl.data.sft import load_sft_records, tokenize_examples
from rl.errors import (
    ConfigError,
    DataError,
    RunError,
)
from rl.models.card import write_model_card
from rl.scripts.common import NO_DATA_ERROR, fail, final_save, preflight, run_training
from rl.scripts.dryrun import dry_run_data, dry_run_report
from rl.trainers.base import check_output_dir
from rl.trainers.sft import SFTConfig, SFTTrainer


def main(argv=None) -> None:
    # 1. parse
    cfg = cli_config(SFTConfig, argv, prog="launch/sft.py", description=__doc__)
    preflight(cfg)  # model names, deepspeed file, resume path, output_dir: before any model
    if not has_data(cfg.data) and not cfg.dry_run:  # a plan needs no data
        fail(NO_DATA_ERROR)
    try:
        if cfg.dry_run:  # the data only when it is here: a plan needs the model's config
            records = dry_run_data(cfg, lambda c: load_sft_records(c.data.path, c))
            if records is not None and not cfg.data.eval_path:
                records = split_eval(records, cfg.data.eval_fraction, cfg.seed)[0]
            dry_run_report(cfg, n_examples=None if records is None else len(records),
                           models={"policy (trainable)": cfg.model_name})
            return
        # 2. setup: data is validated before any model is built, so a bad file fails in seconds
        records = load_sft_records(cfg.data.path, cfg)
        eval_records = load_sft_records(cfg.data.eval_path, cfg, for_eval=True) if cfg.data.eval_path else None
        if eval_records is None:
            records, eval_records = split_eval(records, cfg.data.eval_fraction, cfg.seed)
        check_output_dir(cfg)
        trainer = SFTTrainer(cfg)
        train = tokenize_examples(records, trainer.tokenizer, cfg, cfg.data.path)
        evals = tokenize_examples(eval_records, trainer.tokenizer, cfg, cfg.data.eval_path or cfg.data.path)
    except (ConfigError, DataError, RunError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(trainer, trainer.train, train, evals or None)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    with final_save(cfg.output_dir):  # a full disk: one line, exit 1
        out = trainer.save()
        if trainer.accelerator.is_main_process:
            write_model_card(out, cfg, history, "sft")
    if trainer.accelerator.is_main_process and history:
        first, last = history[0]["loss"], history[-1]["loss"]
        print(f"sft done: loss {first:.4f} -> {last:.4f} over {len(history)} steps; model saved to {out}")


if __name__ == "__main__":
    main()
