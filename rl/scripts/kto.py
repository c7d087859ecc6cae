"""KTO: preference training on unpaired rows (a completion labelled desirable or not).

    python launch/kto.py --config recipes/tiny/kto.yaml
    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file ds_configs/zero3.json \\
        launch/kto.py --config recipes/tiny/kto.yaml
    python launch/kto.py --config recipes/tiny/kto.yaml beta=0.2 undesirable_weight=1.2
    python launch/kto.py --help        # every key, its default and meaning

Data: one row per completion, {"prompt": ..., "completion": ..., "label": true|false} (column names under
data.*: prompt_column, completion_column, label_column), strings or lists of {"role", "content"} messages.
"""

from __future__ import annotations

from rl.data.kto import UnpairedDataset
from rl.errors import (
    ConfigError,
    DataError,
    RunError,
)
from rl.models.card import write_model_card
from rl.scripts.common import fail, final_save, parse_recipe, run_training
from rl.scripts.dryrun import dry_run_data, dry_run_report
from rl.trainers.base import check_output_dir
from rl.trainers.kto import KTOConfig, KTOTrainer


def main(argv=None) -> None:
    # 1. parse
    cfg = parse_recipe(KTOConfig, argv, "launch/kto.py", __doc__, require_data=True)
    try:
        # 2. setup: data is validated before any model is built, so a bad file fails in seconds
        if cfg.dry_run:  # the data only when it is here: a plan needs the model's config
            data = dry_run_data(cfg, KTOTrainer.load_data)
            dry_run_report(cfg, n_examples=None if data is None else len(data[0]), models=KTOTrainer.dry_run_models(cfg))
            return
        records, eval_records = KTOTrainer.load_data(cfg)
        check_output_dir(cfg)
        trainer = KTOTrainer(cfg)
        train = UnpairedDataset.from_records(records, trainer.tokenizer, cfg, cfg.data.path)
        evals = (UnpairedDataset.from_records(eval_records, trainer.tokenizer, cfg,
                                              cfg.data.eval_path or cfg.data.path) if eval_records else None)
        trainer.plan(len(train))  # a dataset smaller than one global batch fails here, in one line
    except (ConfigError, DataError, RunError, ValueError) as e:
        fail(str(e))
    # 3. train (a stop on a signal exits here, after its checkpoint)
    history = run_training(trainer, trainer.train, train, evals)
    # 4. save (every process takes part: ZeRO-3 gathers the weights)
    with final_save(cfg.output_dir):  # a full disk: one line, exit 1
        out = trainer.save()
        if trainer.accelerator.is_main_process:
            write_model_card(out, cfg, history, "kto")
    if trainer.accelerator.is_main_process and history:
        first, last = history[0], history[-1]
        margin = last.get("eval/rewards/margins", last.get("rewards/margins", float("nan")))
        print(f"kto done: loss {first['loss']:.4f} -> {last['loss']:.4f}, reward margin {margin:.3f} over "
              f"{len(history)} steps; model saved to {out}")


if __name__ == "__main__":
    main()
