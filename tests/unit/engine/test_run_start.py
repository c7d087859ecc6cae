"""A full disk before a run starts is one line (issue 49): the run lock, a run's first write into output_dir, and
a tiny model or GGUF conversion written into its cache. Measured on a 64 KB tmpfs full to the last block
(`unshare --user --map-root-user --mount`, then `mount -t tmpfs -o size=64k`): the lock's write ended in
`OSError: [Errno 28]` with its traceback; a full tiny-model cache said "cannot load its tokenizer ... hf download
tiny:llama". Here the same errors are raised at the write itself."""

from __future__ import annotations

import errno
import io

import pytest

from rl.engine import state
from rl.errors import ConfigError, RunError
from rl.models.loading import not_loadable


class _FullDisk(io.StringIO):
    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_the_run_lock_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "open", lambda *a, **k: _FullDisk(), raising=False)
    monkeypatch.setattr(state.fcntl, "flock", lambda *a: None)
    with pytest.raises(RunError) as e:
        state.hold_run_lock(tmp_path / "run")
    assert str(e.value) == (f"no space left on {tmp_path / 'run'} while starting the run (writing .rl-run.lock); "
                            f"free space there or give another output_dir, then rerun")
    assert str(tmp_path / "run") not in state._held


def test_another_error_of_the_lock_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(state, "open", refuse, raising=False)
    with pytest.raises(PermissionError):
        state.hold_run_lock(tmp_path / "run")


def test_a_model_cache_on_a_full_disk_is_named_as_such():
    full = not_loadable("tiny:llama", "tokenizer", OSError(errno.ENOSPC, "No space left on device"))
    assert isinstance(full, ConfigError) and "no space left on device while preparing it in its cache" in str(full)
    assert "hf download" not in str(full)
    missing = not_loadable("org/model", "tokenizer", OSError("We couldn't connect to 'https://huggingface.co'"))
    assert "cannot load its tokenizer" in str(missing) and "hf download org/model" in str(missing)
