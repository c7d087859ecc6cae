"""push_to_hub (rl.models.hub) at huggingface_hub's API boundary: HfApi is replaced by a recorder (no hub is
reachable here), and each hub_strategy makes the calls transformers' Trainer makes for it."""

from types import SimpleNamespace

import pytest

from rl.errors import RunError
from rl.models.hub import MODEL_FILES, HubPusher, hub_plan


class RecordingApi:
    """The HfApi methods HubPusher calls; `fail` makes upload_folder raise (a hub that is down)."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"someone/{repo_id}")

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", repo_id, kw))

    def upload_folder(self, **kw):
        if self.fail:
            raise ConnectionError("hub unreachable")
        self.calls.append(("upload_folder", kw["repo_id"], kw))


def _cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "my-run"), hub_model_id=None, hub_strategy="every_save", hub_token=None,
                hub_private_repo=None, hub_revision=None)
    return SimpleNamespace(**{**base, **kw})


def _uploads(api):
    return [(c[2].get("path_in_repo"), c[2]["commit_message"], c[2].get("allow_patterns"), c[2].get("revision"))
            for c in api.calls if c[0] == "upload_folder"]


@pytest.mark.parametrize("strategy,per_checkpoint", [
    ("end", []),
    ("every_save", [(None, "Training in progress, step 4", MODEL_FILES, None)]),
    ("checkpoint", [(None, "Training in progress, step 4", MODEL_FILES, None),
                    ("last-checkpoint", "Checkpoint of step 4", None, None)]),
    ("all_checkpoints", [(None, "Training in progress, step 4", MODEL_FILES, None),
                         ("checkpoint-4", "Checkpoint of step 4", None, None)]),
])
def test_each_hub_strategy_uploads_what_transformers_does(strategy, per_checkpoint, tmp_path):
    api = RecordingApi()
    pusher = HubPusher(_cfg(tmp_path, hub_strategy=strategy), api=api)
    pusher.checkpoint(tmp_path / "my-run/checkpoints/checkpoint-4", 4)
    assert _uploads(api) == per_checkpoint
    url = pusher.final(tmp_path / "my-run")
    final = [c for c in api.calls if c[0] == "upload_folder"][-1][2]
    assert final["commit_message"] == "End of training" and "checkpoints/**" in final["ignore_patterns"]
    assert url == "https://huggingface.co/someone/my-run"  # the hub put the name under the token's account
    assert [c[0] for c in api.calls].count("create_repo") == 1  # created once, exist_ok
    if strategy == "checkpoint":  # the newest checkpoint replaces the previous one
        assert [c for c in api.calls if c[0] == "upload_folder"][1][2]["delete_patterns"] == ["*"]


def test_repository_name_privacy_and_branch(tmp_path):
    api = RecordingApi()
    pusher = HubPusher(_cfg(tmp_path, hub_model_id="org/model", hub_private_repo=True, hub_revision="dev"), api=api)
    pusher.final(tmp_path)
    assert api.calls[0] == ("create_repo", "org/model", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert api.calls[1] == ("create_branch", "org/model", {"branch": "dev", "exist_ok": True})
    assert api.calls[2][2]["revision"] == "dev"


def test_a_failed_checkpoint_upload_warns_and_a_failed_final_upload_is_one_line(tmp_path):
    lines = []
    pusher = HubPusher(_cfg(tmp_path, hub_model_id="org/m"), api=RecordingApi(fail=True), log=lines.append)
    pusher.checkpoint(tmp_path / "ck", 2)  # training goes on
    assert len(lines) == 1 and lines[0].startswith("warning: push_to_hub: the upload of step 2 to org/m failed")
    with pytest.raises(RunError, match=r"uploading .* to org/m failed \(ConnectionError: hub unreachable\); the model "
                                       r"is saved in .*hf upload org/m"):
        pusher.final(tmp_path)


def test_the_dry_run_plan_asks_the_hub_nothing(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", None)  # any use would fail
    plan = hub_plan(_cfg(tmp_path, hub_strategy="checkpoint"))
    assert plan["repository"] == "https://huggingface.co/<your account>/my-run"
    assert "last-checkpoint" in plan["uploads"] and plan["branch"] == "main"
    assert hub_plan(_cfg(tmp_path, hub_model_id="org/x"))["repository"] == "https://huggingface.co/org/x"
