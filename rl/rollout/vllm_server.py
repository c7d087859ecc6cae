"""vLLM behind a server: `rl vllm-serve --model M` (like `trl vllm-serve`) on other GPUs, another node or
simply another process, and the trainer's client for it.

    rl vllm-serve --model tiny:llama-hd64 --port 8000          # in its own venv if vLLM pins other packages
    python launch/grpo.py --config recipes/tiny/grpo.yaml use_vllm=true vllm_mode=server model_name=tiny:llama-hd64

The trainer's client: rl.rollout.vllm_client. Protocol (plain data and tensors only, so the server may run in another virtual environment):
* HTTP + JSON on `--host:--port`: GET /health, GET /info (the model's shape, to refuse another model),
  POST /generate (prompt token ids and sampling keywords -> token ids, log-probs, finish reasons),
  POST /init_communicator, POST /update_weights, POST /close_communicator.
* Weights travel over a two-rank torch.distributed group (gloo on the CPU, NCCL on GPUs) whose store
  the server holds on `--group-port`; the trainer's main process is rank 0 (the source), the server
  rank 1. An update is a stream of (1 KiB JSON header, tensor) broadcasts ending with an end header,
  fed straight into vLLM's in-place `reload_weights`, so neither side holds more than one tensor extra.
* Every wait is bounded: HTTP calls by `timeout`, the group's collectives by its timeout, so a server
  that is not there, dies or hangs gives one line (`RunError`) instead of the silent hang of a stuck
  weight sync.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoConfig

from rl.errors import RunError
from rl.models.sources import resolve_model_path
from rl.rollout.vllm_client import model_shape, received_weights, weight_group
from rl.rollout.vllm_engine import colocated_llm, completions_of, load_weights



# ------------------------------------------------------------------------------------------- server

class _Server:
    def __init__(self, llm, model_dir: str, host: str, group_port: int):
        self.llm, self.model_dir, self.host, self.group_port = llm, model_dir, host, group_port
        self.shape = model_shape(AutoConfig.from_pretrained(model_dir).get_text_config())
        self.lock = threading.Lock()  # one engine call at a time
        self.pg = self.store = None
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def generate(self, body: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        with self.lock:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in body["prompts"]],
                                     SamplingParams(**body["sampling"]), use_tqdm=False)
        return {"completions": completions_of(outs)}

    def init_communicator(self, body: dict) -> dict:
        backend = "nccl" if self.device == "cuda" else "gloo"

        def join():  # blocks until the trainer joins: answered first, so the trainer can
            self.store, self.pg = weight_group(self.host, self.group_port, 1, float(body.get("timeout", 120)), backend)
        threading.Thread(target=join, daemon=True).start()
        return {"ok": True, "backend": backend}

    def update_weights(self, body: dict) -> dict:
        for _ in range(200):  # the group may still be forming (init_communicator answers first)
            if self.pg is not None:
                break
            time.sleep(0.05)
        if self.pg is None:
            raise RuntimeError("no communicator: POST /init_communicator first")

        with self.lock:
            load_weights(self.llm, received_weights(self.pg, self.device))
        return {"ok": True}

    def close_communicator(self, body: dict) -> dict:
        self.pg = self.store = None
        return {"ok": True}


def serve(model: str, host: str = "0.0.0.0", port: int = 8000, group_port: int = 51216, dtype: str = "auto",
          max_model_len: int = 1024, gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
          seed: int = 0) -> None:
    """Start the engine on `model`, then answer requests until interrupted."""
    model_dir = resolve_model_path(model)
    llm = colocated_llm(model_dir, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                        gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=False, seed=seed)
    state = _Server(llm, model_dir, host, group_port)
    routes = {"/generate": state.generate, "/init_communicator": state.init_communicator,
              "/update_weights": state.update_weights, "/close_communicator": state.close_communicator}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/health":
                return self._send(200, {"ok": True})
            if self.path == "/info":
                return self._send(200, {"model": model, "shape": state.shape, "max_model_len": max_model_len})
            self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self):  # noqa: N802
            fn = routes.get(self.path)
            if fn is None:
                return self._send(404, {"error": f"no route {self.path}"})
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            try:
                self._send(200, fn(body))
            except Exception as e:  # noqa: BLE001 - the client gets the reason as one line
                self._send(500, {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})

        def log_message(self, *args):  # one line per request is noise at one request per step
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    print(f"vLLM server for {model} on http://{host}:{port} (weights group port {group_port})", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="rl vllm-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model to serve: a hub id, a local directory, tiny:<family> or a "
                   "packaged name (smollm2-135m-instruct); the trainer's model_name")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (the trainer's vllm_server_port; default 8000)")
    p.add_argument("--group-port", type=int, default=51216, help="port of the weight-sync group's store (the "
                   "trainer's vllm_group_port; default 51216)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: auto; float32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=1024, help="prompt + completion tokens per request at most "
                   "(at least the trainer's max_length)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory vLLM may use")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (tensor parallel)")
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    a = p.parse_args(argv)
    try:
        serve(a.model, a.host, a.port, a.group_port, a.dtype, a.max_model_len, a.gpu_memory_utilization,
              a.tensor_parallel_size, a.seed)
    except RunError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
