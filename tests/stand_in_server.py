"""A streaming stand-in for the GPU server of `vllm serve` (tests/test_bench_tpot_cpu.py: in
the test process, and as the server process its driver test starts)."""
from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler


class StandInServer(BaseHTTPRequestHandler):
    """GET /health, and POST /v1/completions as vLLM streams it: one SSE chunk per token,
    TOKEN_S apart, then the usage chunk and [DONE]. Records every request body."""

    TOKEN_S = 0.003
    requests: list = []

    def do_GET(self):  # vllm serve's /health
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(self.TOKEN_S)
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": " x"}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": 20, "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass
