"""The trainer's side of `rl vllm-serve` (rl.rollout.vllm_server: the protocol is described there), and what both
sides share: the model-shape check, the two-rank weight group and the weight stream over it (`send_weights` /
`received_weights`, buckets of rl.engine.weight_sync). Needs no vLLM: the trainer's venv may lack it."""

from __future__ import annotations

import datetime
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from rl.engine.weight_sync import Bucket, pack_buckets, unpack_bucket
from rl.errors import RunError, first_line

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


def _control(meta: dict, device) -> torch.Tensor:
    raw = json.dumps(meta).encode()
    return torch.frombuffer(bytearray(raw.ljust(HEADER_BYTES)), dtype=torch.uint8).to(device)


def _payload(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def send_weights(pg, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device, src: int = 0) -> int:
    """Broadcast (name, tensor) pairs from rank `src` of `pg` as messages, each (control, [header], payload):
    a HEADER_BYTES control block of JSON with the tensors' names, dtypes, shapes and offsets (or, when they do
    not fit, the length of a header broadcast next), then the payload bytes. With `bucket_bytes` > 0 a message
    is a bucket of tensors (rl.engine.weight_sync.pack_buckets); with 0 one tensor, its own bytes (no copy).
    Ends with an end control block. Returns the tensors sent."""
    if bucket_bytes > 0:
        # each bucket is sent (and waited for) before the next is packed: one buffer serves them all
        messages = ((b.header(), b.buffer) for b in pack_buckets(weights, bucket_bytes, reuse=True))
    else:
        messages = (([[n, str(t.dtype).removeprefix("torch."), list(t.shape), 0]], _payload(t)) for n, t in weights)
    n = 0
    for header, payload in messages:
        raw = json.dumps({"tensors": header, "bytes": payload.numel()}).encode()
        if len(raw) <= HEADER_BYTES:
            pg.broadcast(_control(json.loads(raw), device), src).wait()
        else:
            pg.broadcast(_control({"header_bytes": len(raw)}, device), src).wait()
            pg.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device), src).wait()
        pg.broadcast(payload.to(device), src).wait()
        n += len(header)
    pg.broadcast(_control({"end": True}, device), src).wait()
    return n


def received_weights(pg, device, src: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving end of `send_weights`: (name, tensor) pairs as they arrive, views into each message's
    payload (a fresh buffer per message, so a consumer may keep them)."""
    while True:
        control = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
        pg.broadcast(control, src).wait()
        meta = json.loads(bytes(control.cpu().tolist()).decode().rstrip())
        if meta.get("end"):
            return
        if "header_bytes" in meta:
            raw = torch.empty(meta["header_bytes"], dtype=torch.uint8, device=device)
            pg.broadcast(raw, src).wait()
            meta = json.loads(bytes(raw.cpu().tolist()).decode())
        payload = torch.empty(meta["bytes"], dtype=torch.uint8, device=device)
        pg.broadcast(payload, src).wait()
        yield from unpack_bucket(Bucket.from_header(meta["tensors"], payload))


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
        """Ask /info until the server answers (at most `timeout` seconds), then check it serves a model of the
        policy's shape (`model_shape`); returns the server's info."""
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

    def generate(self, prompts: list[list[int]], sampling: dict | list[dict]) -> list[list[dict]]:
        """Completions per prompt (`sampling`: one dict of vLLM SamplingParams keywords per prompt, or one for all)."""
        return self._call("/generate", {"prompts": prompts, "sampling": sampling})["completions"]

    def init_communicator(self) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._call("/init_communicator", {"timeout": self.timeout})
        try:
            self.store, self.pg = weight_group(self.host, self.group_port, 0, self.timeout, backend)
        except RuntimeError as e:
            raise RunError(f"could not join the vLLM server's weight group at {self.host}:{self.group_port} within "
                           f"{self.timeout:g} s ({first_line(e)}); vllm_group_port must be the server's "
                           f"--group-port and reachable from here") from None

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 0) -> int:
        """Stream the weights to the server (`send_weights`; it loads them as they arrive); returns the tensors sent."""
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
        try:
            n = send_weights(self.pg, weights, bucket_bytes, "cuda" if torch.cuda.is_available() else "cpu")
        except RuntimeError as e:
            self.pg = None
            raise RunError(f"weight sync to the vLLM server at {self.base} failed ({first_line(e, 200)}): the server "
                           "stopped or hung") from None
        th.join(self.timeout)
        if "e" in answer:
            raise answer["e"]
        if "r" not in answer:
            raise RunError(f"the vLLM server at {self.base} did not confirm the weight update within {self.timeout:g} s")
        return n
