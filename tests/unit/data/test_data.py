"""Data validation: every bad input is a one-line DataError naming file, line and column."""

import json

import pytest

from rl.data.chat import render_chat
from rl.data.records import LengthReport, load_records
from rl.errors import DataError


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
    with pytest.raises(DataError, match=r"d.jsonl:1: no column 'text' \(columns present: body, title\); rename"):
        load_records(p, ["text"])


def test_a_missing_column_names_the_key_that_maps_it_and_the_likely_column(tmp_path):
    """file:line, the column, the columns present and the data.*_column key, with the column that probably holds
    it (`data.prompt_column=question`); every trainer's loader passes its keys."""
    from rl.data.columns import column_keys
    from rl.trainers.dpo import DPOConfig

    p = write(tmp_path, "d.jsonl", '{"question": "1+1=", "answer": "2"}\n')
    d = DPOConfig(model_name="m").data
    with pytest.raises(DataError) as e:
        load_records(p, [d.prompt_column], keys=column_keys(d))
    assert str(e.value) == (f"{p}:1: no column 'prompt' (columns present: answer, question); set "
                            f"data.prompt_column=question if that column holds it, or rename the column in the data")
    with pytest.raises(DataError, match=r"no column 'chosen' .*; set data.chosen_column=<the column that holds it>"):
        load_records(p, [d.chosen_column], keys=column_keys(d))


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
    from rl.data.records import read_records

    repo = _hub_layout_repo(tmp_path / "repo")
    recs = load_records(repo, ["prompt", "completion"])  # default config, split train
    assert [r["prompt"] for r in recs] == ["p0", "p1", "p2"]
    assert [r["_line"] for r in recs] == ["train row 1", "train row 2", "train row 3"]
    assert [r["completion"] for r in load_records(repo, ["completion"], split="test")] == ["tc"]
    assert [r["answer"] for r in load_records(repo, ["problem", "answer"], name="math")] == ["2", "2"]
    # our validation layer still runs, naming the source and the row
    with pytest.raises(DataError, match=r"repo \(train row 1\): no column 'text' \(columns present: completion, prompt\)"):
        load_records(repo, ["text"])
    with pytest.raises(DataError, match=r"repo: .*'nope'.*default.*math.*\(set data.name\)$"):
        read_records(repo, name="nope")
    with pytest.raises(DataError, match=r"repo: .*validation.*train.*test.*\(set data.split \(or data.eval_split\)\)$"):
        read_records(repo, split="validation")


def test_data_keys_reach_the_loader(tmp_path):
    """data.name / data.split / data.eval_split from a recipe pick the config and splits of a trainer's
    train and eval data (SFT's loader here; the other trainers call the same source_options)."""
    from rl.config.fields import build
    from rl.data.sft import load_sft_records
    from rl.trainers.sft import SFTConfig

    repo = _hub_layout_repo(tmp_path / "repo")
    cfg = build(SFTConfig, {"model_name": "tiny:llama", "data": {"path": str(repo), "eval_path": str(repo)}})
    assert (cfg.data.split, cfg.data.eval_split, cfg.data.name) == ("train", "test", None)
    assert [r["prompt"] for r in load_sft_records(str(repo), cfg)] == ["p0", "p1", "p2"]
    assert [r["prompt"] for r in load_sft_records(str(repo), cfg, for_eval=True)] == ["tp"]


def test_hub_id_offline_is_one_line(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    from rl.data.records import read_records

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

    from rl.data.records import read_records

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                               "test": datasets.Dataset.from_list([{"text": "b"}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert [r["text"] for r in read_records(tmp_path / "dd")] == ["a"]
    assert [r["text"] for r in read_records(tmp_path / "dd", split="test")] == ["b"]
    with pytest.raises(DataError, match=r"without a 'dev' split \(splits: train, test\); set data.split"):
        read_records(tmp_path / "dd", split="dev")


# ------------------------------------------------------------------------------------ streaming


def test_streaming_reads_the_same_first_rows(tmp_path):
    """data.streaming on a folder laid out like a Hub repository (parquet shards; jsonl shards) gives
    the rows and locations of a full load, cut at the limit, and reads no further: a broken second
    shard fails the full load but not a stream that stops in the first."""
    from rl.data.records import read_records

    repo = _hub_layout_repo(tmp_path / "repo")
    full = read_records(repo)
    assert read_records(repo, streaming=True, limit=2) == full[:2]
    assert read_records(repo, streaming=True, limit=2)[1]["_line"] == "train row 2"
    assert read_records(repo, name="math", streaming=True, limit=5) == read_records(repo, name="math")
    jl = tmp_path / "jl" / "data"
    jl.mkdir(parents=True)
    (jl / "train-00000-of-00002.jsonl").write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(4)))
    (jl / "train-00001-of-00002.jsonl").write_text('{"text": "broken"\n')
    streamed = read_records(jl.parent, streaming=True, limit=3)
    assert [(r["text"], r["_line"]) for r in streamed] == [("t0", "train row 1"), ("t1", "train row 2"),
                                                           ("t2", "train row 3")]
    with pytest.raises(DataError, match=r"jl: could not read its data files \(.*\); fix or remove the broken file$"):
        read_records(jl.parent)  # the whole load does reach the broken shard
    with pytest.raises(DataError, match=r"repo: data.streaming reads only the first data.max_examples rows; "
                                        r"set data.max_examples"):
        read_records(repo, streaming=True)


def test_streaming_key_needs_max_examples_and_reaches_the_loader(tmp_path):
    from rl.config.fields import build
    from rl.data.sft import load_sft_records
    from rl.errors import ConfigError
    from rl.trainers.sft import SFTConfig

    repo = _hub_layout_repo(tmp_path / "repo")
    with pytest.raises(ConfigError, match=r"^r.yaml: key 'data.streaming' .*set data.max_examples"):
        build(SFTConfig, {"model_name": "tiny:llama", "data": {"path": str(repo), "streaming": True}}, "r.yaml")
    cfg = build(SFTConfig, {"model_name": "tiny:llama",
                            "data": {"path": str(repo), "streaming": True, "max_examples": 2}})
    assert [r["prompt"] for r in load_sft_records(str(repo), cfg)] == ["p0", "p1"]


# ------------------------------------------------------------------------------------ mixtures


def test_mixture_counts_hand_computed():
    from rl.data.records import mixture_counts

    assert mixture_counts([0.7, 0.3], [100, 100], 10) == [7, 3]  # exact: Fraction("0.7"), not 0.69999
    assert mixture_counts([1, 1, 1], [5, 5, 5], 7) == [3, 2, 2]  # 7/3 each, the leftover 1 to the first
    assert mixture_counts([1, 2], [50, 50], 10) == [3, 7]  # 3.33 -> 3, 6.67 -> 6 + the leftover
    # no total: until a source runs out at its weight; N* = min(100/0.7, 6/0.3) = min(142, 20) = 20
    assert mixture_counts([0.7, 0.3], [100, 6], None) == [14, 6]
    # N* = min(10/0.7, 2/0.3) = min(14, 6) = 6; 4.2 -> 4 and 1.8 -> 1, the leftover to 1.8 (larger remainder)
    assert mixture_counts([0.7, 0.3], [10, 2], None) == [4, 2]
    assert mixture_counts([0.7, 0.3], [10, 2], 100) == [4, 2]  # a total the sources cannot fill is capped
    assert mixture_counts([3], [4], None) == [4]


def _mixture_files(tmp_path, n_a=10, n_b=10):
    a = write(tmp_path, "a.jsonl", "".join(json.dumps({"text": f"a{i}"}) + "\n" for i in range(1, n_a + 1)))
    b = write(tmp_path, "b.jsonl", "".join(json.dumps({"text": f"b{i}"}) + "\n" for i in range(1, n_b + 1)))
    return a, b


def test_mixture_rows_proportions_order_and_locations(tmp_path):
    from rl.data.records import read_records

    a, b = _mixture_files(tmp_path)
    mix = [{"path": str(a), "weight": 0.7}, {"path": str(b), "weight": 0.3}]
    rows = read_records(None, mixture=mix, limit=10, seed=0)
    texts = [r["text"] for r in rows]
    # 7 rows of a and 3 of b, each source's first rows in its own order
    assert [t for t in texts if t[0] == "a"] == [f"a{i}" for i in range(1, 8)]
    assert [t for t in texts if t[0] == "b"] == ["b1", "b2", "b3"]
    # every row keeps its source's file:line
    assert {r["_line"] for r in rows} == {f"{a}:{i}" for i in range(1, 8)} | {f"{b}:{i}" for i in range(1, 4)}
    assert all(r["_line"] == f"{a if r['text'][0] == 'a' else b}:{r['text'][1:]}" for r in rows)
    # seeded: the same seed the same order; another seed (Python's Random, the same on every machine) another
    assert read_records(None, mixture=mix, limit=10, seed=0) == rows
    orders = {tuple(r["text"] for r in read_records(None, mixture=mix, limit=10, seed=s)) for s in range(4)}
    assert len(orders) > 1
    # without a total: until b runs out at its weight (b has 2 rows: 4 of a and 2 of b, as hand-computed above)
    (tmp_path / "small").mkdir()
    a2, b2 = _mixture_files(tmp_path / "small", 10, 2)
    short = read_records(None, mixture=[{"path": str(a2), "weight": 0.7}, {"path": str(b2), "weight": 0.3}], seed=0)
    assert sorted(r["text"] for r in short) == ["a1", "a2", "a3", "a4", "b1", "b2"]


def test_mixture_of_a_file_and_a_repository_streamed(tmp_path):
    """A mixture entry takes name/split as data.name/data.split do; with streaming each source fetches at
    most data.max_examples rows."""
    from rl.data.records import read_records

    a, _ = _mixture_files(tmp_path)
    repo = _hub_layout_repo(tmp_path / "repo")
    mix = [{"path": str(a), "weight": 1}, {"path": str(repo), "name": "default", "split": "test", "weight": 1}]
    for streaming in (False, True):
        rows = read_records(None, mixture=mix, limit=2, seed=3, streaming=streaming)
        assert sorted(r["_line"] for r in rows) == sorted([f"{a}:1", f"{repo} (test row 1)"])


def test_mixture_config_errors_are_one_line():
    from rl.config.fields import build
    from rl.errors import ConfigError
    from rl.trainers.sft import SFTConfig

    def err(data):
        with pytest.raises(ConfigError) as e:
            build(SFTConfig, {"model_name": "tiny:llama", "data": data}, "r.yaml")
        assert "\n" not in str(e.value) and str(e.value).startswith("r.yaml: key")
        return str(e.value)

    good = {"path": "a.jsonl", "weight": 1}
    assert "'data.mixture[1].weight' must be a positive number" in err({"mixture": [good, {"path": "b", "weight": 0}]})
    assert "'data.mixture[0].weight' must be a positive number" in err({"mixture": [{"path": "b", "weight": -1}]})
    assert "'data.mixture[0].weight' must be a positive number" in err({"mixture": [{"path": "b"}]})
    assert "'data.path' and 'data.mixture' are alternatives" in err({"path": "x.jsonl", "mixture": [good]})
    assert "'data.mixture[0]' has unknown key 'wieght' (allowed: path, weight, name, split)" in err(
        {"mixture": [{"path": "b", "wieght": 1}]})
    assert "'data.mixture[0].path' must be" in err({"mixture": [{"weight": 1}]})
    assert "'data.mixture' is empty" in err({"mixture": []})


def test_mixture_reaches_every_trainers_loader(tmp_path):
    """A recipe's data.mixture (data.path unset) is read by SFT, DPO, reward, PPO and GRPO loaders through
    source_options, seeded by the recipe's seed, with max_examples as the total; a bad row is named by
    its own file and line; the launch scripts count a mixture as data."""
    from rl.config.fields import build
    from rl.data.preference import load_pair_records
    from rl.data.sft import load_sft_records
    from rl.models.card import card_text
    from rl.scripts.common import parse_recipe
    from rl.trainers.dpo import DPOConfig
    from rl.trainers.grpo import GRPOTrainer
    from rl.trainers.grpo_config import GRPOConfig
    from rl.trainers.ppo_config import PPOConfig, load_prompt_data
    from rl.trainers.reward import RewardModelTrainer
    from rl.trainers.reward_config import RewardTrainConfig
    from rl.trainers.sft import SFTConfig

    pair = {"prompt": "p", "chosen": "c", "rejected": "r", "text": "t"}
    a = write(tmp_path, "a.jsonl", "".join(json.dumps({**pair, "prompt": f"a{i}"}) + "\n" for i in range(1, 7)))
    b = write(tmp_path, "b.jsonl", "".join(json.dumps({**pair, "prompt": f"b{i}"}) + "\n" for i in range(1, 7)))
    data = {"mixture": [{"path": str(a), "weight": 2}, {"path": str(b), "weight": 1}], "max_examples": 6}
    base = {"model_name": "tiny:llama", "seed": 5, "data": data}

    def prompts(rows):
        return sorted(r["prompt"] if isinstance(r, dict) else r for r in rows)

    want = ["a1", "a2", "a3", "a4", "b1", "b2"]
    sft = build(SFTConfig, {**base, "data": {**data, "completion_column": "chosen"}})  # prompt/completion rows
    assert prompts(load_sft_records(None, sft)) == want
    assert prompts(load_pair_records(build(DPOConfig, base))[0]) == want
    assert sorted(RewardModelTrainer.load_data(build(RewardTrainConfig, base))[0].prompts) == want
    ppo = build(PPOConfig, {**base, "data": {**data, "text_column": "prompt"}})
    assert prompts(load_prompt_data(ppo)[0]) == want
    grpo_rows = GRPOTrainer.load_data(build(GRPOConfig, base))
    assert prompts(grpo_rows) == want
    # the order follows the seed, identically in every trainer
    assert [r["prompt"] for r in grpo_rows] == load_prompt_data(ppo)[0]
    assert parse_recipe(SFTConfig, ["--config", str(write(tmp_path, "r.yaml", json.dumps(base)))], "sft", "",
                        require_data=True).data.mixture == data["mixture"]
    assert f"| data | `{a} x2, {b} x1` |" in card_text(sft, [], "sft")  # the model card names the sources
    # a bad row names its source file and line, not the mixture
    b.write_text(b.read_text().replace('"chosen": "c"', '"chosen": ""', 1))
    with pytest.raises(DataError, match=rf"^{b}:1: column 'chosen' is empty$"):
        load_pair_records(build(DPOConfig, base))


def test_a_chat_row_with_an_unknown_role_is_one_line_naming_file_line_and_the_fix(tmp_path):
    """`"role": "asistant"` (a typo) or `"hacker"` is refused with file:line, not rendered as some other turn
    (the loss mask would follow the typo)."""
    import json

    from rl.data.records import load_records
    from rl.errors import DataError

    for role, hint in (("asistant", "did you mean 'assistant'?"), ("hacker", "system, user, assistant, tool")):
        path = tmp_path / f"{role}.jsonl"
        rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
                {"messages": [{"role": "user", "content": "2+2?"}, {"role": role, "content": "4"}]}]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(DataError) as e:
            load_records(path, columns=["messages"], chat_columns=["messages"])
        msg = str(e.value)
        assert f"{role}.jsonl:2" in msg and f"role {role!r}" in msg and hint in msg and "\n" not in msg


def test_data_name_on_a_file_and_a_loading_script_are_one_line(tmp_path):
    """data.name with a local .jsonl was silently ignored; a dataset folder with a loading script raised
    datasets' RuntimeError traceback (the script is never run: right, but it must be one line)."""
    import json

    from rl.data.records import read_records
    from rl.errors import DataError

    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(DataError, match=r"rows.jsonl: data.name='main' .* drop data.name"):
        read_records(f, name="main")
    folder = tmp_path / "scripted"
    folder.mkdir()
    (folder / "scripted.py").write_text("raise SystemExit('a loading script must never run')\n")
    with pytest.raises(DataError, match=r"scripted: .*script.* was not run") as e:
        read_records(folder)
    assert "\n" not in str(e.value)
