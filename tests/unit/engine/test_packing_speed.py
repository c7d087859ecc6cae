"""The fast packed paths stay exact: per-sequence attention over packed rows (rl.engine.segments) equals
SDPA under transformers' block-diagonal mask and the padded batch (logits, loss, gradients); SFT packing
uses it; DPO with packing (per-sequence attention too) equals the padded step; bf16 autocast on CPU stays
within bf16 tolerance of fp32."""

import random

import pytest
import torch

from rl.data.preference import pack_pairs
from rl.data.sft import collate
from rl.engine import segments
from rl.engine.losses import token_logprobs
from rl.engine.packing import pack_examples, pack_sequences, pack_shared_prompts, unpack_targets
from rl.models.tiny import build_config

EXAMPLES = [  # unequal lengths, a prompt masked with -100, a one-token example (two position-0s in a row)
    {"input_ids": [5, 17, 42, 9, 100, 7], "labels": [-100, -100, 42, 9, 100, 7]},
    {"input_ids": [250], "labels": [250]},
    {"input_ids": [11, 12, 13], "labels": [11, 12, 13]},
    {"input_ids": [200, 3, 77, 78, 79, 80, 81, 82, 83], "labels": [-100, -100, -100, 77, 78, 79, 80, 81, 82]},
]


def _model(family="llama", seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(build_config(family, 259, hidden=32, layers=2, heads=2),
                                             attn_implementation="sdpa").float()
    m.train()
    return m


def _nll_and_grads(model, ids, labels, **kw):
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False, **kw).logits
    logp, mask = token_logprobs(logits, labels)
    nll = -(logp * mask).sum()
    nll.backward()
    return logits.detach(), nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_cu_seq_lens_by_hand():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 0, 1, 2, 3]])
    assert segments.cu_seq_lens(pos).tolist() == [0, 3, 4, 6, 8, 12]
    assert segments.cu_seq_lens(torch.tensor([[3, 4, 5]])).tolist() == [0, 3]  # a row starts a sequence


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_segment_attention_equals_the_mask_and_the_padded_batch(family):
    """One packed row (SFT) and several rows with a padding segment (DPO's layout): the same logits,
    summed NLL and every parameter's gradient under rl_segments as under SDPA's block-diagonal mask,
    and the same per-token NLL as the padded batch (label boundaries between examples included)."""
    model = _model(family)
    b = pack_examples(EXAMPLES)
    masked = _nll_and_grads(model, b["input_ids"], b["labels"], position_ids=b["position_ids"])
    padded = collate(EXAMPLES, 0)
    pad_logits, pad_nll, pad_grads = _nll_and_grads(model, padded["input_ids"], padded["labels"],
                                                    attention_mask=padded["attention_mask"])
    assert segments.enable(model) and model.config._attn_implementation == segments.NAME
    seg = _nll_and_grads(model, b["input_ids"], b["labels"], **segments.model_inputs(b["position_ids"]))
    assert torch.allclose(seg[0], masked[0], atol=1e-5)
    assert seg[1] == pytest.approx(float(masked[1]), rel=1e-6)
    assert seg[1] == pytest.approx(float(pad_nll), rel=1e-6)
    for n, g in seg[2].items():
        assert torch.allclose(g, masked[2][n], atol=1e-5, rtol=1e-4), n
        assert torch.allclose(g, pad_grads[n], atol=1e-5, rtol=1e-4), n
    # without cu_seq_lens the registered function IS sdpa (padded batches, generation, evaluation)
    again = _nll_and_grads(model, padded["input_ids"], padded["labels"], attention_mask=padded["attention_mask"])
    assert torch.equal(again[0], pad_logits)
    # several rows, each ending in a padding segment
    seqs = [(e["input_ids"], e["labels"]) for e in EXAMPLES] + [([9, 8, 7, 6, 5, 4, 3, 2, 1, 2], [1] * 10)]
    rows = pack_sequences(seqs, pad_id=0)
    assert rows["input_ids"].shape[0] > 1 and (rows["sequence_index"] == -1).any()
    seg_rows = _nll_and_grads(model, rows["input_ids"], rows["labels"], **segments.model_inputs(rows["position_ids"]))
    model.config._attn_implementation = "sdpa"
    mask_rows = _nll_and_grads(model, rows["input_ids"], rows["labels"], position_ids=rows["position_ids"])
    real = rows["sequence_index"] >= 0
    assert torch.allclose(seg_rows[0][real], mask_rows[0][real], atol=1e-5)
    for n, g in seg_rows[2].items():
        assert torch.allclose(g, mask_rows[2][n], atol=1e-5, rtol=1e-4), n


def test_without_boundaries_the_packed_row_attends_across_examples():
    """Negative control: rl_segments given one boundary for the whole row (cu_seq_lens [0, W]) lets the
    later examples attend to the earlier ones, so their logits differ: the boundaries are what isolates them."""
    model = _model()
    segments.enable(model)
    b = pack_examples(EXAMPLES)
    W = b["input_ids"].shape[1]
    whole = torch.tensor([0, W], dtype=torch.int32)
    with torch.no_grad():
        right = model(input_ids=b["input_ids"], use_cache=False, **segments.model_inputs(b["position_ids"])).logits
        wrong = model(input_ids=b["input_ids"], use_cache=False, position_ids=b["position_ids"],
                      cu_seq_lens_q=whole, cu_seq_lens_k=whole).logits
    n0 = len(EXAMPLES[0]["input_ids"])
    assert torch.allclose(right[0, :n0], wrong[0, :n0], atol=1e-5)  # the first example sees only itself anyway
    assert not torch.allclose(right[0, n0:], wrong[0, n0:], atol=1e-3)



def _rollout_batch():
    """A GRPO-like batch: 3 prompts (one of a single token) x 2-3 completions of uneven lengths, prompts
    left-padded to 5 columns, completions right-padded to 6; one completion token is a tool's (label -100)."""
    prompts = [[5, 17, 42, 9], [250], [11, 12, 13, 14, 15]]
    groups = [[[60, 61, 62], [70], [80, 81, 82, 83, 84, 85]], [[90, 91]] * 2, [[100, 101, 102], [110, 111]]]
    P, N = 5, 6
    rows = [(p, c) for p, cs in zip(prompts, groups) for c in cs]
    ids = torch.zeros(len(rows), P + N, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, P - len(p):P], ids[i, P:P + len(c)] = torch.tensor(p), torch.tensor(c)
        mask[i, P - len(p):P + len(c)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :P] = -100
    labels[0, P + 1] = -100
    return ids, mask, labels, P


def test_shared_prompts_by_hand():
    ids, mask, labels, P = _rollout_batch()
    b = pack_shared_prompts(ids, mask, labels, P)
    # prompt [5,17,42,9]: prefix [5,17,42], then [9, completion] per row; [250] has no prefix
    assert b["input_ids"][0, :11].tolist() == [5, 17, 42, 9, 60, 61, 62, 9, 70, 9, 80]
    assert b["position_ids"][0, :11].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 3, 4]
    assert b["labels"][0, :9].tolist() == [-100, -100, -100, -100, 60, -100, 62, -100, 70]
    assert b["cu_seq_lens"].tolist()[:5] == [0, 3, 7, 9, 16]
    assert b["prefix_of"].tolist() == [-1, 0, 0, 0, -1, -1, -1, 6, 6]
    # tokens: each prompt but its last token once, then per row that token and the completion (not 8 x 11)
    assert b["input_ids"].shape[1] == (3 + 0 + 4) + sum(n + 1 for n in (3, 1, 6, 2, 2, 3, 2))
    assert b["target_index"][0, P - 1:P + 2].tolist() == [3, 4, 5]  # predicted from the 9 copy, 60, 61
    assert (b["target_index"][0, :P - 1] == -1).all() and (b["target_index"][0, P + 2:] == -1).all()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shared_prompts_equal_the_padded_batch(family):
    """Completions that share their prompt's forward (prefix segments) get the padded batch's per-token
    log-probs and every parameter's gradient of a per-token weighted sum."""
    model = _model(family)
    ids, mask, labels, P = _rollout_batch()
    weights = torch.linspace(0.5, 2.0, ids.shape[1] - 1)  # distinct per position, as advantages x tokens

    def run(**kw):
        model.zero_grad()
        logits = model(use_cache=False, **kw).logits
        return logits

    from rl.engine.packing import position_ids_from_mask

    logits = run(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    lp_pad, m_pad = token_logprobs(logits, labels)
    (lp_pad * weights).sum().backward()
    g_pad = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert segments.enable(model)
    b = pack_shared_prompts(ids, mask, labels, P)
    logits = run(input_ids=b["input_ids"], **segments.shared_prefix_inputs(b))
    lp, m = token_logprobs(logits, b["labels"])
    lp, m = unpack_targets(lp, b["target_index"]), unpack_targets(m, b["target_index"])
    assert torch.equal(m, m_pad)
    assert torch.allclose(lp, lp_pad, atol=1e-5)
    (lp * weights).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, g_pad[n], atol=1e-5, rtol=1e-4), n
    # negative control: without the prefixes the completions see no prompt, and their log-probs change
    alone = dict(segments.shared_prefix_inputs(b), rl_prefix_of=torch.full_like(b["prefix_of"], -1))
    with torch.no_grad():
        lp_alone = token_logprobs(model(input_ids=b["input_ids"], use_cache=False, **alone).logits, b["labels"])[0]
    assert not torch.allclose(unpack_targets(lp_alone, b["target_index"])[0], lp_pad[0], atol=1e-3)


def test_shared_prompts_reject_a_layout_they_cannot_read():
    ids, mask, labels, P = _rollout_batch()
    mask[0, P] = 0  # a hole at the completion's start
    with pytest.raises(ValueError, match="row 0"):
        pack_shared_prompts(ids, mask, labels, P)

def test_enable_leaves_other_attention_kernels_alone():
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_config(build_config("llama", 259, hidden=32, layers=2, heads=2),
                                                 attn_implementation="eager")
    assert not segments.enable(eager) and eager.config._attn_implementation == "eager"


def test_sft_packing_runs_per_example_attention_and_equals_padding(tmp_path, tiny_llama, monkeypatch):
    """SFT with packing routes the model through rl_segments (every training forward carries the
    examples' boundaries) and its losses and grad norms equal the padded path's."""
    from rl.config.fields import build
    from rl.trainers.sft import SFTConfig, SFTTrainer

    calls = []
    real = segments.cu_seq_lens
    monkeypatch.setattr(segments, "cu_seq_lens", lambda pos: calls.append(pos.shape) or real(pos))
    rng = random.Random(0)
    data = []
    for _ in range(8):
        n = rng.randint(1, 20)
        ids = [rng.randrange(3, 250) for _ in range(n)]
        data.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
    rows, trainers = {}, {}
    for packing in (False, True):
        cfg = build(SFTConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / str(packing)), per_device_train_batch_size=4,
                                    max_steps=2, learning_rate=1e-2, seed=0, report_to=["none"], packing=packing,
                                    dtype="float32"))
        trainers[packing] = SFTTrainer(cfg)
        rows[packing] = trainers[packing].train(data)
    assert trainers[True].pipeline.unwrapped_model.config._attn_implementation == segments.NAME
    assert trainers[False].pipeline.unwrapped_model.config._attn_implementation == "sdpa"
    assert len(calls) == 2  # one packed training forward per step
    for a, b in zip(rows[False], rows[True]):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def _dpo_step_grads(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch, **over):
    """Loss and every parameter's gradient of one default DPO step (the gradients read just before
    the optimizer applies them)."""
    from rl.config.fields import build
    from rl.data.preference import PreferenceDataset
    from rl.engine.pipeline import ForwardBackwardPipeline
    from rl.trainers.dpo import DPOConfig, DPOTrainer

    grads = {}
    original = ForwardBackwardPipeline._optim_step

    def snap(self, *a, **kw):
        grads.update({n: p.grad.clone() for n, p in self.unwrapped_model.named_parameters() if p.grad is not None})
        return original(self, *a, **kw)

    monkeypatch.setattr(ForwardBackwardPipeline, "_optim_step", snap)
    rng = random.Random(1)
    P = [f"q{i}: " + "z" * rng.randint(0, 20) for i in range(6)]
    C = ["a" * rng.randint(1, 30) for _ in P]
    R = ["b" * rng.randint(1, 30) for _ in P]
    cfg = build(DPOConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / str(over)), per_device_train_batch_size=6, max_steps=1,
                                seed=0, max_length=96, max_prompt_length=32, report_to=["none"], dtype="float32",
                                **over))
    t = DPOTrainer(cfg, tokenizer=tiny_tokenizer)
    row = t.train(PreferenceDataset(P, C, R, tiny_tokenizer, 96, 32))[0]
    return cfg, {**row, "attn": t.pipeline.unwrapped_model.config._attn_implementation}, grads


def test_packed_dpo_equals_the_padded_loss_and_gradients(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch):
    """One DPO step (policy + reference forwards) gives the padded batch's loss and gradients when packed
    (`packing`) and when each pair's prompt is computed once for both answers (`share_prompt_forward`,
    the default)."""
    from rl.data.preference import pack_pairs_shared

    monkeypatch.setattr("rl.engine.tracking.plot_history", lambda *a, **k: None)
    packs, shares = [], []
    monkeypatch.setattr("rl.trainers.dpo.pack_pairs", lambda *a, **k: packs.append(1) or pack_pairs(*a, **k))
    monkeypatch.setattr("rl.trainers.dpo.pack_pairs_shared",
                        lambda *a, **k: shares.append(1) or pack_pairs_shared(*a, **k))
    cfg, packed, g_packed = _dpo_step_grads(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch, packing=True,
                                            share_prompt_forward=False)
    assert cfg.packing and packs and not shares  # packs the training and reference forwards
    assert packed["attn"] == segments.NAME  # and attends per sequence
    n_packs = len(packs)
    _, padded, g_padded = _dpo_step_grads(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch, share_prompt_forward=False)
    assert len(packs) == n_packs and padded["attn"] == "sdpa" and not shares
    _, shared, g_shared = _dpo_step_grads(tmp_path, tiny_llama, tiny_tokenizer, monkeypatch)  # the default
    # one collation serves the training and the reference forward
    assert len(packs) == n_packs and len(shares) == 1 and shared["attn"] == segments.NAME
    for other, g_other in ((packed, g_packed), (shared, g_shared)):
        assert other["loss"] == pytest.approx(padded["loss"], abs=1e-6)
        assert other["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
        assert set(g_other) == set(g_padded) and g_other
        for n, g in g_other.items():
            assert torch.allclose(g, g_padded[n], atol=1e-6, rtol=1e-4), n
    assert any(float(g.abs().max()) > 1e-4 for g in g_packed.values())  # the gradients are not all ~0


def test_shared_pairs_by_hand():
    from rl.data.preference import pack_pairs_shared

    b = pack_pairs_shared([{"prompt_ids": [1, 2, 3], "chosen_ids": [7, 8], "rejected_ids": [9]},
                           {"prompt_ids": [4], "chosen_ids": [5], "rejected_ids": [6, 6]}], 0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 7, 8, 3, 9, 4, 5, 4, 6, 6]]
    assert b["labels"].tolist() == [[-100, -100, -100, 7, 8, -100, 9, -100, 5, -100, 6, 6]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 0, 1, 2]]
    # chosen answers are sequences 0..B-1, rejected B..2B-1 (pack_pairs' numbering); prefixes -1
    assert b["sequence_index"].tolist() == [[-1, -1, 0, 0, 0, 2, 2, 1, 1, 3, 3, 3]]
    assert b["cu_seq_lens"].tolist() == [0, 2, 5, 7, 9, 12] and b["prefix_of"].tolist() == [-1, 0, 0, -1, -1]


def test_bf16_autocast_on_cpu_stays_within_bf16_tolerance_of_fp32():
    """The SFT loss and gradients of a packed batch under CPU bf16 autocast (what dtype: bfloat16 gives
    a trainer on CPU: fp32 weights, bf16 matmuls) against fp32: loss within 1%, each gradient's
    direction within cosine 0.99 and its norm within 5% (bf16 keeps 8 bits of mantissa)."""
    model = _model()
    b = pack_examples(EXAMPLES)
    segments.enable(model)
    kw = segments.model_inputs(b["position_ids"])
    _, nll32, g32 = _nll_and_grads(model, b["input_ids"], b["labels"], **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, nll16, g16 = _nll_and_grads(model, b["input_ids"], b["labels"], **kw)
    assert logits.dtype == torch.bfloat16  # autocast did run the matmuls in bf16
    assert float(nll16) == pytest.approx(float(nll32), rel=1e-2)
    assert float(nll16) != float(nll32)
    for n, g in g32.items():
        assert g16[n].dtype == torch.float32  # fp32 master gradients
        if float(g.norm()) < 1e-6:
            continue
        cos = torch.nn.functional.cosine_similarity(g.flatten(), g16[n].flatten(), dim=0)
        assert float(cos) > 0.99, n
        assert float(g16[n].norm()) == pytest.approx(float(g.norm()), rel=5e-2), n


def test_sft_trainer_bf16_on_cpu_autocasts_and_tracks_fp32(tmp_path, tiny_llama, monkeypatch):
    """dtype: bfloat16 on CPU: the trainer's accelerator autocasts in bf16 and two steps' losses stay
    within bf16 tolerance of the fp32 run's, with the packed segments' backward in fp32 SDPA and in bf16
    matmuls (`_BF16Backward`, forced here for segments of any length, as if the CPU had native bf16)."""
    from accelerate.state import AcceleratorState

    from rl.config.fields import build
    from rl.trainers.sft import SFTConfig, SFTTrainer

    data = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (5, 12, 9, 16)]
    rows = {}
    for run in ("float32", "bfloat16", "bfloat16-matmul-backward"):
        if run.endswith("backward"):
            monkeypatch.setattr(segments, "BF16_BACKWARD_MIN", 1)
            monkeypatch.setattr(segments, "_native_bf16", lambda: True)
        else:
            monkeypatch.setattr(segments, "_native_bf16", lambda: False)
        dtype = run.split("-")[0]
        AcceleratorState._reset_state()  # accelerate keeps one mixed-precision setting per process
        cfg = build(SFTConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / run), per_device_train_batch_size=4, max_steps=2,
                                    learning_rate=1e-3, seed=0, report_to=["none"], packing=True, dtype=dtype))
        t = SFTTrainer(cfg)
        rows[run] = t.train(data)
        assert t.accelerator.mixed_precision == ("bf16" if dtype == "bfloat16" else "no")
        assert next(t.pipeline.unwrapped_model.parameters()).dtype == torch.float32
    AcceleratorState._reset_state()  # leave the process's default (no mixed precision) to the next test
    for run in ("bfloat16", "bfloat16-matmul-backward"):
        for a, b in zip(rows["float32"], rows[run]):
            assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), run
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-1), run
    assert rows["bfloat16-matmul-backward"][0]["grad_norm"] != rows["bfloat16"][0]["grad_norm"]  # another backward ran


def test_common_prefix_by_hand():
    from rl.engine.packing import pack_common_prefix

    ex = [{"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, -100, 4, 5]},
          {"input_ids": [1, 2, 3, 9], "labels": [-100, -100, -100, 9]},
          {"input_ids": [1, 2, 7, 7, 7], "labels": [-100, -100, -100, 7, 7]}]
    b = pack_common_prefix(ex)  # shared: [1, 2] (the third example differs at its 3rd token)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 2, 3, 9, 2, 7, 7, 7]]
    assert b["labels"].tolist() == [[-100, -100, -100, 4, 5, -100, -100, 9, -100, -100, 7, 7]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 1, 2, 3, 1, 2, 3, 4]]
    assert b["prefix_of"].tolist() == [-1, 0, 0, 0]
    # a labeled token is never shared (the loss would count it once instead of per example)
    assert pack_common_prefix([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 2) is None
    assert pack_common_prefix(ex[:1]) is None


def test_sft_shares_the_common_prompt_prefix_and_equals_padding(tmp_path, tiny_llama, monkeypatch):
    """SFT with packing computes the micro-batch's common unlabeled prefix once (share_prompt_forward,
    the default) and its losses and grad norms equal the padded path's and the unshared packed path's."""
    import rl.trainers.sft as sft
    from rl.config.fields import build

    shared = []
    real = sft.pack_common_prefix
    monkeypatch.setattr(sft, "pack_common_prefix", lambda ex: (lambda b: shared.append(b is not None) or b)(real(ex)))
    rng = random.Random(1)
    system = [257, 40, 41, 42, 43, 44, 45]  # the "system prompt" every example starts with
    data = []
    for _ in range(8):
        q = [rng.randrange(3, 250) for _ in range(rng.randint(1, 6))]
        a = [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
        data.append({"input_ids": system + q + a, "labels": [-100] * (len(system) + len(q)) + a})
    rows = {}
    for name, over in (("padded", {}), ("packed", {"packing": True, "share_prompt_forward": False}),
                       ("shared", {"packing": True})):
        cfg = build(sft.SFTConfig, dict(model_name=tiny_llama, output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                                        max_steps=2, learning_rate=1e-2, seed=0, report_to=["none"],
                                        dtype="float32", **over))
        rows[name] = sft.SFTTrainer(cfg).train(data)
    assert shared == [True, True]  # both steps' micro-batches shared their prefix
    for name in ("packed", "shared"):
        for a, b in zip(rows["padded"], rows[name]):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert b["mean_token_accuracy"] == pytest.approx(a["mean_token_accuracy"])


def test_bf16_segments_attend_in_fp32_and_give_bf16_back():
    """Under CPU bf16 the packed segments' attention runs in fp32 (faster SDPA kernels on short sequences):
    the output and the gradients stay bf16, and equal the fp32 attention of the same bf16 inputs rounded to
    bf16, within bf16 tolerance of attention computed in bf16 throughout."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    W, lens = 24, [7, 12, 5]
    q = torch.randn(1, 4, W, 16).bfloat16().requires_grad_()
    k = torch.randn(1, 2, W, 16).bfloat16().requires_grad_()
    v = torch.randn(1, 2, W, 16).bfloat16().requires_grad_()
    cu = torch.tensor([0, 7, 19, 24])
    out, _ = segments._segment_attention(module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu)
    assert out.dtype == torch.bfloat16 and out.shape == (1, W, 4, 16)
    out.float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16

    def per_segment(q, k, v):
        outs, s = [], 0
        for n in lens:
            o, _ = sdpa_attention_forward(module, q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n], None,
                                          scaling=0.25, is_causal=True)
            outs.append(o)
            s += n
        return torch.cat(outs, dim=1)

    with torch.no_grad():
        fp32 = per_segment(q.float(), k.float(), v.float())
        bf16 = per_segment(q, k, v)
    assert torch.equal(out.detach(), fp32.bfloat16())
    assert (out.detach().float() - bf16.float()).abs().max() < 0.05


@pytest.mark.parametrize("n,m", [(1, 0), (7, 0), (40, 0), (9, 5), (30, 12)])
def test_bf16_backward_of_a_segment_matches_fp64_at_bf16_precision(n, m):
    """_BF16Backward (bf16 training on a CPU with native bf16): one segment of n queries over m prefix keys
    (all visible) and its own n (causal), 6 query heads over 2 key/value heads. Its output is the fp32
    attention rounded to bf16; its gradients are within bf16 precision of fp64's, as close as SDPA computing
    in bf16 throughout gets (the relative error of each gradient's largest entry at most twice SDPA's + 1e-3)."""
    import torch.nn.functional as F

    torch.manual_seed(n + m)
    q = torch.randn(1, 6, n, 64).bfloat16().requires_grad_()
    k = torch.randn(1, 2, m + n, 64).bfloat16().requires_grad_()
    v = torch.randn(1, 2, m + n, 64).bfloat16().requires_grad_()
    dout = torch.randn(1, 6, n, 64).bfloat16()
    visible = torch.ones(n, m + n, dtype=torch.bool).tril(m)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

    def grads(f, cast):
        for t in (q, k, v):
            t.grad = None
        out = f(*(cast(t) for t in (q, k, v)))
        out.backward(dout.to(out.dtype))
        return [out.detach().double()] + [t.grad.double() for t in (q, k, v)]

    exact = grads(sdpa, lambda t: t.double())
    ours = grads(lambda q, k, v: segments._BF16Backward.apply(q, k, v, 64 ** -0.5), lambda t: t)
    bf16 = grads(sdpa, lambda t: t)
    assert torch.equal(ours[0], grads(sdpa, lambda t: t.float())[0].bfloat16().double())  # the fp32 forward
    for name, a, b, e in zip(("dq", "dk", "dv"), ours[1:], bf16[1:], exact[1:]):
        scale = e.abs().max()
        assert float((a - e).abs().max() / scale) <= 2 * float((b - e).abs().max() / scale) + 1e-3, name


def test_packed_bf16_training_takes_the_bf16_backward_only_with_native_bf16(monkeypatch):
    """The packed segments under CPU bf16 autocast with gradients: the bf16-matmul backward where the CPU has
    native bf16 (for segments of BF16_BACKWARD_MIN tokens or more), fp32 SDPA otherwise; both train the same model to within bf16 tolerance (loss and gradients),
    and a forward without gradients never takes it."""
    calls = []
    monkeypatch.setattr(segments, "BF16_BACKWARD_MIN", 1)  # EXAMPLES' segments are 1-9 tokens
    original = segments._BF16Backward.apply
    monkeypatch.setattr(segments._BF16Backward, "apply", lambda *a: calls.append(1) or original(*a))
    b = pack_examples(EXAMPLES)
    runs = {}
    for native in (False, True):
        monkeypatch.setattr(segments, "_native_bf16", lambda native=native: native)
        model = _model()
        segments.enable(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[native] = _nll_and_grads(model, b["input_ids"], b["labels"], **segments.model_inputs(b["position_ids"]))
        assert bool(calls) == native
    assert len(calls) == 2 * 4  # 2 layers x 4 segments
    assert float(runs[True][1]) == pytest.approx(float(runs[False][1]), rel=1e-2)
    for n, g in runs[False][2].items():
        if float(g.norm()) > 1e-6:
            assert float(torch.nn.functional.cosine_similarity(g.flatten(), runs[True][2][n].flatten(), dim=0)) > 0.99, n
    calls.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=b["input_ids"], use_cache=False, **segments.model_inputs(b["position_ids"]))
    assert not calls
