"""Data validation: every bad input is a one-line DataError naming file, line and column."""

import json

import pytest

from rl.data import DataError, LengthReport, load_records, render_chat


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_jsonl_csv_parquet_and_saved_dir(tmp_path):
    import datasets

    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "d", "chosen": "e", "rejected": "f"}]
    jl = write(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    csv = write(tmp_path, "d.csv", "prompt,chosen,rejected\na,b,c\nd,e,f\n")
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    js = write(tmp_path, "d.json", json.dumps(rows))
    for path in (jl, csv, tmp_path / "d.parquet", tmp_path / "saved", js):
        recs = load_records(path, ["prompt", "chosen", "rejected"])
        assert [(r["prompt"], r["chosen"]) for r in recs] == [("a", "b"), ("d", "e")], path
    assert [r["_line"] for r in load_records(jl, ["prompt"])] == [1, 2]
    assert [r["_line"] for r in load_records(csv, ["prompt"])] == [2, 3]  # line 1 is the header


def test_missing_file_and_empty(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        load_records(tmp_path / "nope.jsonl", ["text"])
    with pytest.raises(DataError, match="no examples"):
        load_records(write(tmp_path, "e.jsonl", "\n\n"), ["text"])


def test_malformed_json_names_the_line(tmp_path):
    p = write(tmp_path, "bad.jsonl", '{"text": "ok"}\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON"):
        load_records(p, ["text"])


def test_missing_column_lists_present_ones(tmp_path):
    p = write(tmp_path, "d.jsonl", '{"body": "x", "title": "y"}\n')
    with pytest.raises(DataError, match=r"missing column 'text' \(columns present: body, title\)"):
        load_records(p, ["text"])


def test_non_string_and_empty_values(tmp_path):
    p = write(tmp_path, "d.jsonl", '{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: column 'text' must be a string, got int"):
        load_records(p, ["text"])
    p = write(tmp_path, "d2.jsonl", '{"text": "ok"}\n{"text": "  "}\n')
    with pytest.raises(DataError, match=r"d2.jsonl:2: column 'text' is empty"):
        load_records(p, ["text"])


def test_chat_messages_validated_and_rendered(tmp_path, tiny_tokenizer):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    p = write(tmp_path, "c.jsonl", json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl:2: column 'messages' message 0"):
        load_records(p, ["messages"], chat_columns=["messages"])
    text = render_chat(tiny_tokenizer, good["messages"][:1], add_generation_prompt=True)
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def test_length_report_truncates_or_fails():
    rep = LengthReport(max_length=3)
    assert rep.fit([1, 2, 3, 4, 5]) == [1, 2, 3] and rep.fit([1]) == [1]
    assert (rep.seen, rep.truncated) == (2, 1)
    with pytest.raises(DataError, match="5 tokens > max_length=3"):
        LengthReport(max_length=3, strict=True).fit([1, 2, 3, 4, 5], "f.jsonl:4")


def _hub_layout_repo(root):
    """A folder laid out like a Hub dataset repository: parquet shards under data/ and a README whose
    YAML front matter declares two configs (default: train/test; math: train only)."""
    import datasets

    (root / "data").mkdir(parents=True)
    (root / "math").mkdir()
    datasets.Dataset.from_list([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)]).to_parquet(
        str(root / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list([{"prompt": "tp", "completion": "tc"}]).to_parquet(
        str(root / "data" / "test-00000-of-00001.parquet"))
    datasets.Dataset.from_list([{"problem": "1+1", "answer": "2"}] * 2).to_parquet(
        str(root / "math" / "train-00000-of-00001.parquet"))
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "  - split: test\n    path: data/test-*\n- config_name: math\n  data_files:\n  - split: train\n"
        "    path: math/train-*\n---\n# a tiny dataset\n")
    return root


def test_dataset_repository_folder_configs_and_splits(tmp_path):
    from rl.data import read_records

    repo = _hub_layout_repo(tmp_path / "repo")
    recs = load_records(repo, ["prompt", "completion"])  # default config, split train
    assert [r["prompt"] for r in recs] == ["p0", "p1", "p2"]
    assert [r["_line"] for r in recs] == ["train row 1", "train row 2", "train row 3"]
    assert [r["completion"] for r in load_records(repo, ["completion"], split="test")] == ["tc"]
    assert [r["answer"] for r in load_records(repo, ["problem", "answer"], name="math")] == ["2", "2"]
    # our validation layer still runs, naming the source and the row
    with pytest.raises(DataError, match=r"repo: missing column 'text' \(columns present: completion, prompt\)"):
        load_records(repo, ["text"])
    with pytest.raises(DataError, match=r"repo: .*'nope'.*default.*math.*\(set data.name\)$"):
        read_records(repo, name="nope")
    with pytest.raises(DataError, match=r"repo: .*validation.*train.*test.*\(set data.split \(or data.eval_split\)\)$"):
        read_records(repo, split="validation")


def test_data_keys_reach_the_loader(tmp_path):
    """data.name / data.split / data.eval_split from a recipe pick the config and splits of a trainer's
    train and eval data (SFT's loader here; the other trainers call the same source_options)."""
    from rl.config import build
    from rl.sft import SFTConfig, load_sft_records

    repo = _hub_layout_repo(tmp_path / "repo")
    cfg = build(SFTConfig, {"model_name": "tiny:llama", "data": {"path": str(repo), "eval_path": str(repo)}})
    assert (cfg.data.split, cfg.data.eval_split, cfg.data.name) == ("train", "test", None)
    assert [r["prompt"] for r in load_sft_records(str(repo), cfg)] == ["p0", "p1", "p2"]
    assert [r["prompt"] for r in load_sft_records(str(repo), cfg, for_eval=True)] == ["tp"]


def test_hub_id_offline_is_one_line(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    from rl.data import read_records

    with pytest.raises(DataError) as e:
        read_records("trl-lib/Capybara")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("trl-lib/Capybara: not a local file or folder")
    assert "could not be reached" in msg and "set data.path to DIR" in msg
    # a missing path that cannot be a hub id is still a missing file
    with pytest.raises(DataError, match="data file not found: nope/x.jsonl"):
        read_records("nope/x.jsonl")


def test_saved_datasetdict_split(tmp_path):
    import datasets

    from rl.data import read_records

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                               "test": datasets.Dataset.from_list([{"text": "b"}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert [r["text"] for r in read_records(tmp_path / "dd")] == ["a"]
    assert [r["text"] for r in read_records(tmp_path / "dd", split="test")] == ["b"]
    with pytest.raises(DataError, match=r"without a 'dev' split \(splits: train, test\); set data.split"):
        read_records(tmp_path / "dd", split="dev")
