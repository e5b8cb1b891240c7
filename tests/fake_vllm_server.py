"""A small stand-in for a vLLM OpenAI-compatible server (``vllm serve DIR``) on 127.0.0.1, for the
vLLM-teacher client's tests: ``/v1/models`` and ``/v1/completions`` with token-id prompts and
``prompt_logprobs``, answered as vLLM 0.26's server writes them (``choices[i].prompt_logprobs``: None
for position 0, then per position {"<id>": {"logprob", "rank", "decoded_token"}} holding the prompt's
token and the top K; ``prompt_token_ids`` with ``return_token_ids``; errors as ``{"error":
{"message", ...}}`` with the HTTP status), the log-probs computed by an HF model over its rows.
``mode`` plants faults: ``error`` (HTTP 400), ``shifted`` (every position's answer one later),
``garbage`` (not JSON). The request loop is bounded: it stops by itself after ``max_requests``
requests or ``max_seconds``, whichever comes first.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch


def prompt_logprobs(model, seq: list[int], k: int) -> list:
    """vLLM's prompt log-probs of ``seq`` under ``model`` (temperature 1, over its rows)."""
    with torch.no_grad():
        logits_S_V = model(input_ids=torch.tensor([seq])).logits[0].float()
    logp_S_V = logits_S_V.log_softmax(-1)
    out: list = [None]
    for i in range(1, len(seq)):
        row_V = logp_S_V[i - 1]
        entry = {}
        if k:
            vals, ids = row_V.topk(k)
            entry = {str(int(t)): {"logprob": float(v), "rank": r + 1, "decoded_token": None}
                     for r, (v, t) in enumerate(zip(vals, ids))}
        tok = seq[i]
        entry.setdefault(str(tok), {"logprob": float(row_V[tok]), "rank": int((row_V > row_V[tok]).sum()) + 1,
                                    "decoded_token": None})
        out.append(entry)
    return out


class FakeVLLMServer:
    def __init__(self, model, root: str, name: str = "teacher", mode: str = "ok", max_requests: int = 50,
                 max_seconds: float = 300.0):
        self.model, self.root, self.name, self.mode = model, root, name, mode
        self.requests: list[dict] = []
        self.handled = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, status: int, body) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.handled += 1
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": fake.name, "object": "model", "root": fake.root, "max_model_len": 4096}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "NotFound", "code": 404}})

            def do_POST(self):
                fake.handled += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if fake.mode == "error":
                    return self._send(400, {"error": {"message": "Requested prompt logprobs of 16, which is greater "
                                                      "than max allowed: 5", "type": "BadRequestError", "code": 400}})
                if fake.mode == "garbage":
                    return self._send(200, b"<html>proxy error</html>")
                choices = []
                for i, seq in enumerate(body["prompt"]):
                    plp = prompt_logprobs(fake.model, seq, body.get("prompt_logprobs") or 0)
                    if fake.mode == "shifted":
                        plp = [None] + plp[:-1]
                    choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length",
                                    "prompt_logprobs": plp,
                                    "prompt_token_ids": seq if body.get("return_token_ids") else None})
                self._send(200, {"id": "cmpl-fake", "object": "text_completion", "model": fake.name, "choices": choices,
                                 "usage": {"prompt_tokens": sum(map(len, body["prompt"])), "completion_tokens": 0}})

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.timeout = 0.2
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        deadline = time.monotonic() + max_seconds

        def loop():
            while self.handled < max_requests and time.monotonic() < deadline and not self._stop:
                self.httpd.handle_request()  # one request, or none within the timeout
            self.httpd.server_close()

        self._stop = False
        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
