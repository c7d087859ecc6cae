"""`rl vllm-serve --model M` (like `trl vllm-serve`): a vLLM engine in a process of its own, on other GPUs, another
node or simply another process, serving the training processes of one launch (its main process speaks for them
all: rl.rollout.vllm_batching). The trainer's side, and what both sides share: rl.rollout.vllm_client.

    rl vllm-serve --model tiny:llama-hd64 --port 8000          # in its own venv if vLLM pins other packages
    python launch/grpo.py --config recipes/tiny/grpo.yaml use_vllm=true vllm_mode=server model_name=tiny:llama-hd64

Protocol (plain data and tensors only, so the server may run in another virtual environment):
* HTTP + JSON on `--host:--port`: GET /health, GET /info (the model's shape, to refuse another model),
  POST /generate (prompt token ids and one dict of sampling keywords per prompt -> token ids, log-probs,
  finish reasons), POST /init_communicator (a new weight group; a trainer connecting again replaces the
  previous one), POST /update_weights.
* Weights travel over a two-rank torch.distributed group (gloo on the CPU, NCCL on GPUs) whose store
  the server holds on `--group-port`; the trainer's main process is rank 0 (the source), the server
  rank 1. An update is a stream of buckets (`send_weights` / `received_weights`), fed into vLLM's
  in-place `reload_weights` as they arrive.
* Every wait is bounded: HTTP calls by the client's timeout, the group's collectives by its timeout, so a
  server that is not there, dies or hangs gives one line (`RunError`) on the trainer's side instead of the
  silent hang of a stuck weight sync. The server logs every failed request with its traceback (stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoConfig

from rl.errors import RunError, first_line
from rl.models.sources import resolve_model_path
from rl.rollout.vllm_client import model_shape, received_weights, weight_group
from rl.rollout.vllm_engine import engine_call, engine_kwargs, in_process_llm, load_weights

log = logging.getLogger("rl.vllm_server")


class _Server:
    """The routes' work: the engine behind a lock (one call at a time), and the weight group."""

    def __init__(self, llm, model_dir: str, host: str, group_port: int):
        self.llm, self.model_dir, self.host, self.group_port = llm, model_dir, host, group_port
        self.shape = model_shape(AutoConfig.from_pretrained(model_dir).get_text_config())
        self.lock = threading.Lock()
        self.pg = self.store = None
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def generate(self, body: dict) -> dict:
        prompts, sampling = body["prompts"], body["sampling"]
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        t0 = time.time()
        with self.lock:
            completions = engine_call(self.llm)(prompts, samplings)
        log.debug("generate: %d prompts, %d completions in %.2f s", len(prompts),
                  sum(len(c) for c in completions), time.time() - t0)
        return {"completions": completions}

    def init_communicator(self, body: dict) -> dict:
        backend = "nccl" if self.device == "cuda" else "gloo"
        with self.lock:  # a trainer that connects again (or another one): its group replaces the old one
            self.pg = self.store = None
            gc.collect()  # the old store's listening socket on --group-port closes with it

        def join():  # blocks until the trainer joins: answered first, so the trainer can
            try:
                self.store, self.pg = weight_group(self.host, self.group_port, 1, float(body.get("timeout", 120)),
                                                   backend)
            except Exception:  # noqa: BLE001 - the trainer sees its own timeout; the log says why here
                log.exception("the weight group on port %d did not form", self.group_port)
        threading.Thread(target=join, daemon=True).start()
        return {"ok": True, "backend": backend}

    def update_weights(self, body: dict) -> dict:
        for _ in range(200):  # the group may still be forming (init_communicator answers first)
            if self.pg is not None:
                break
            time.sleep(0.05)
        if self.pg is None:
            raise RuntimeError("no weight group: POST /init_communicator first")
        t0 = time.time()
        with self.lock:
            load_weights(self.llm, received_weights(self.pg, self.device))
        log.debug("weights loaded in %.2f s", time.time() - t0)
        return {"ok": True}


def serve(model: str, host: str = "0.0.0.0", port: int = 8000, group_port: int = 51216, dtype: str = "auto",
          max_model_len: int = 1024, gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
          seed: int = 0, verbose: bool = False) -> None:
    """Start the engine on `model`, then answer requests until interrupted."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    if tensor_parallel_size > 1:
        raise RunError("--tensor-parallel-size > 1 is not built for the server: it loads the pushed weights in place "
                       "in its own process, which vLLM's multiprocess executor cannot do (its collective_rpc pickles "
                       "its arguments); run one server per GPU, or vllm_mode=colocate with vllm_tensor_parallel_size")
    model_dir = resolve_model_path(model)
    llm = in_process_llm(engine_kwargs(model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                       gpu_memory_utilization=gpu_memory_utilization,
                                       tensor_parallel_size=tensor_parallel_size), verbose)
    state = _Server(llm, model_dir, host, group_port)
    routes = {"/generate": state.generate, "/init_communicator": state.init_communicator,
              "/update_weights": state.update_weights}

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
            except Exception as e:  # noqa: BLE001 - the client gets the reason as one line, the log the traceback
                log.exception("POST %s failed", self.path)
                self._send(500, {"error": f"{type(e).__name__}: {first_line(e)}"})

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
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine: 1 (tensor parallelism is built "
                   "for colocate: vllm_tensor_parallel_size)")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (requests the trainer seeds sample from "
                   "their own seeds)")
    p.add_argument("--verbose", action="store_true", help="vLLM's INFO log and one line per request (default: "
                   "vLLM at WARNING, and failed requests)")
    a = p.parse_args(argv)
    try:
        serve(a.model, a.host, a.port, a.group_port, a.dtype, a.max_model_len, a.gpu_memory_utilization,
              a.tensor_parallel_size, a.seed, a.verbose)
    except RunError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
