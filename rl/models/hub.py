"""Uploading a run to the Hugging Face Hub: TRL's (transformers') `push_to_hub`, `hub_model_id`, `hub_strategy`,
`hub_token`, `hub_private_repo` and `hub_revision`, through huggingface_hub's `HfApi` (`create_repo`,
`create_branch`, `upload_folder`).

What goes where, by `hub_strategy` (transformers' meanings):
    end              at the end: output_dir (the model, its card README.md, config.yaml, metrics), no checkpoints
    every_save       that, and at each checkpoint its model files (weights or adapter, config, tokenizer) at the
                     repository's root, so the hub holds the newest weights while the run goes on
    checkpoint       every_save, and the newest checkpoint whole (optimizer state included) in last-checkpoint/,
                     to resume elsewhere (resume=last-checkpoint after a download)
    all_checkpoints  every_save, and every checkpoint whole in its own folder (checkpoint-N/)
The repository is `hub_model_id` (org/name, or a name the hub puts under the token's account), else the
output_dir's name; it is created when missing (`hub_private_repo`), on the branch `hub_revision` when given.

`hub_plan(cfg)` is what --dry-run prints: where it would upload and what, without touching the hub. A failed
upload of a checkpoint is one warning line and the run goes on; a failed final upload is a `RunError` (exit 1)
that says the model is saved locally and how to upload it by hand.
"""

from __future__ import annotations

from pathlib import Path

from rl.errors import RunError, first_line

# a checkpoint's files that make the model loadable (the rest, optimizer/scheduler/RNG state, is for resuming)
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "adapter_config.json", "tokenizer*",
               "special_tokens_map.json", "chat_template.jinja", "vocab.*", "merges.txt", "*.model", "README.md"]
NOT_UPLOADED = ["checkpoints/**", ".*", "**/.*"]  # output_dir's checkpoints go by the strategy; hidden files never

WHAT = {"end": "at the end, output_dir (model, card, config.yaml, metrics)",
        "every_save": "the model at each checkpoint, and output_dir at the end",
        "checkpoint": "the model at each checkpoint plus the newest checkpoint in last-checkpoint/, and output_dir "
                      "at the end",
        "all_checkpoints": "the model at each checkpoint plus every checkpoint in its own folder, and output_dir at "
                           "the end"}


def repo_name(cfg) -> str:
    """The repository as configured: hub_model_id, else output_dir's name (the hub adds the account when the name
    has no org/)."""
    return cfg.hub_model_id or Path(cfg.output_dir).resolve().name


def hub_plan(cfg) -> dict:
    """What a run would upload and where, for --dry-run (no call to the hub)."""
    name = repo_name(cfg)
    repo = name if "/" in name else f"<your account>/{name}"
    return {"repository": f"https://huggingface.co/{repo}", "branch": cfg.hub_revision or "main",
            "private": cfg.hub_private_repo, "hub_strategy": cfg.hub_strategy, "uploads": WHAT[cfg.hub_strategy]}


class HubPusher:
    """The uploads of one run (main process only). `api`: a huggingface_hub HfApi (default: one with hub_token)."""

    def __init__(self, cfg, api=None, log=print):
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(token=cfg.hub_token)
        self.cfg, self.api, self.log = cfg, api, log
        self.repo_id: str | None = None

    def _repo(self) -> str:
        """The repository, created when missing (and the branch hub_revision), once per run."""
        if self.repo_id is None:
            url = self.api.create_repo(repo_name(self.cfg), private=self.cfg.hub_private_repo, exist_ok=True,
                                       repo_type="model")
            self.repo_id = getattr(url, "repo_id", None) or repo_name(self.cfg)
            if self.cfg.hub_revision:
                self.api.create_branch(self.repo_id, branch=self.cfg.hub_revision, exist_ok=True)
        return self.repo_id

    def _upload(self, folder: Path, message: str, **kw) -> None:
        self.api.upload_folder(repo_id=self._repo(), folder_path=str(folder), commit_message=message,
                               revision=self.cfg.hub_revision, **kw)

    def checkpoint(self, path: str | Path, step: int) -> None:
        """After checkpoint `path` (step `step`) is written: the uploads hub_strategy asks for. A failure is one
        warning line; training goes on (the final upload tries again)."""
        strategy, path = self.cfg.hub_strategy, Path(path)
        if strategy == "end":
            return
        try:
            self._upload(path, f"Training in progress, step {step}", allow_patterns=MODEL_FILES)
            if strategy == "checkpoint":
                self._upload(path, f"Checkpoint of step {step}", path_in_repo="last-checkpoint",
                             delete_patterns=["*"])
            elif strategy == "all_checkpoints":
                self._upload(path, f"Checkpoint of step {step}", path_in_repo=path.name)
        except Exception as e:  # noqa: BLE001 - network, auth, quota: the run is not lost for an upload
            self.log(f"warning: push_to_hub: the upload of step {step} to {self.repo_id or repo_name(self.cfg)} "
                     f"failed ({type(e).__name__}: {first_line(e)}); training goes on")

    def final(self, out_dir: str | Path) -> str:
        """Upload output_dir (model, card, config, metrics; not its checkpoints). Returns the repository's URL."""
        try:
            self._upload(Path(out_dir), "End of training", ignore_patterns=NOT_UPLOADED)
        except Exception as e:  # noqa: BLE001 - whatever the hub answered: one line, the model is safe
            raise RunError(f"push_to_hub: uploading {out_dir} to {self.repo_id or repo_name(self.cfg)} failed "
                           f"({type(e).__name__}: {first_line(e)}); the model is saved in {out_dir}: upload it with "
                           f"`hf upload {self.repo_id or repo_name(self.cfg)} {out_dir}`") from None
        return f"https://huggingface.co/{self.repo_id}"
