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
