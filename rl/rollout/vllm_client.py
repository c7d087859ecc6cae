"""The trainer's side of `rl vllm-serve` (rl.rollout.vllm_server: the protocol is described there), and what both
sides share: the model-shape check and the two-rank weight group. Needs no vLLM: the trainer's venv may lack it."""

from __future__ import annotations

import datetime
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Iterable

import torch
import torch.distributed as dist

from rl.errors import RunError

HEADER_BYTES = 1024
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def model_shape(config) -> dict:
    """What must match between the policy and the served model (a config object or a dict)."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    return {k: get(k) for k in SHAPE_KEYS}


def weight_group(host: str, port: int, rank: int, timeout: float, backend: str):
    """A two-rank process group of its own (not the default group: the trainer's launch has that)."""
    td = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, 2, is_master=(rank == 1), timeout=td, wait_for_workers=False)
    prefix = dist.PrefixStore("rl-weights", store)
    if backend == "nccl":
        return store, dist.ProcessGroupNCCL(prefix, rank, 2, dist.ProcessGroupNCCL.Options())
    return store, dist.ProcessGroupGloo(prefix, rank, 2, td)


def _header(meta: dict) -> torch.Tensor:
    raw = json.dumps(meta).encode()
    if len(raw) > HEADER_BYTES:
        raise RunError(f"weight name too long for the sync header: {meta.get('name', '')[:80]}...")
    return torch.tensor(list(raw.ljust(HEADER_BYTES)), dtype=torch.uint8)


class ServerClient:
    """The trainer's side: generate over HTTP; the main process pushes weights over the group."""

    def __init__(self, host: str, port: int, timeout: float, group_port: int = 51216):
        self.base, self.host, self.timeout, self.group_port = f"http://{host}:{port}", host, timeout, group_port
        self.pg = self.store = None

    def _call(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            msg = json.loads(e.read() or b"{}").get("error", str(e))
            raise RunError(f"the vLLM server at {self.base} failed {path}: {msg}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RunError(f"the vLLM server at {self.base} did not answer {path} ({reason}): is `rl vllm-serve` "
                           f"still running there? (vllm_server_host / vllm_server_port)") from None

    def wait_ready(self, expect: dict | None = None) -> dict:
        """Poll /health until the server answers (at most `timeout` seconds), then check it serves a model
        of the policy's shape (`model_shape`)."""
        deadline = time.time() + self.timeout
        while True:
            try:
                info = self._call("/info", timeout=5)
                break
            except RunError:
                if time.time() > deadline:
                    raise RunError(f"no vLLM server answered at {self.base} within vllm_server_timeout="
                                   f"{self.timeout:g} s: start one with `rl vllm-serve --model <model_name> --port "
                                   f"{self.base.rsplit(':', 1)[1]}`, or set vllm_mode=colocate") from None
                time.sleep(1.0)
        if expect is not None and model_shape(info["shape"]) != expect:
            raise RunError(f"the vLLM server at {self.base} serves {info['model']} {info['shape']}, another model than "
                           f"the policy {expect}: start it with the trainer's model_name")
        return info

    def generate(self, prompts: list[list[int]], sampling: dict) -> list[list[dict]]:
        return self._call("/generate", {"prompts": prompts, "sampling": sampling})["completions"]

    def init_communicator(self) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._call("/init_communicator", {"timeout": self.timeout})
        try:
            self.store, self.pg = weight_group(self.host, self.group_port, 0, self.timeout, backend)
        except RuntimeError as e:
            raise RunError(f"could not join the vLLM server's weight group at {self.host}:{self.group_port} within "
                           f"{self.timeout:g} s ({str(e).splitlines()[0]}); vllm_group_port must be the server's "
                           f"--group-port and reachable from here") from None

    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream the weights to the server (it loads them as they arrive); returns the tensors sent."""
        if self.pg is None:
            self.init_communicator()
        answer: dict = {}

        def post():  # answered once the server has loaded everything
            try:
                answer["r"] = self._call("/update_weights", {})
            except RunError as e:
                answer["e"] = e
        th = threading.Thread(target=post, daemon=True)
        th.start()
        n = 0
        try:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            for name, t in weights:
                t = t.detach().to(dev).contiguous()
                self.pg.broadcast(_header({"name": name, "dtype": str(t.dtype).split(".")[-1],
                                           "shape": list(t.shape)}).to(dev), 0).wait()
                self.pg.broadcast(t, 0).wait()
                n += 1
            self.pg.broadcast(_header({"end": True}).to(dev), 0).wait()
        except RuntimeError as e:
            self.pg = None
            raise RunError(f"weight sync to the vLLM server at {self.base} failed after {n} tensors "
                           f"({str(e).splitlines()[0][:200]}): the server stopped or hung") from None
        th.join(self.timeout)
        if "e" in answer:
            raise answer["e"]
        if "r" not in answer:
            raise RunError(f"the vLLM server at {self.base} did not confirm the weight update within {self.timeout:g} s")
        return n
