"""A stand-in for `python -m vllm.entrypoints.openai.api_server` that starts in a fraction of a
second: a startup failure as vLLM reports one, an engine process in the server's session as vLLM's
are, /health, and /v1/completions answering token ids. It tests how draftsmith starts and stops a
server (draftsmith/target/vllm_server.py serve), not vLLM."""

import argparse
import http.server
import json
import subprocess
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--model")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
config = Path(args.model) / "config.json"
if config.is_file() and json.loads(config.read_text()).get("model_type") == "nosuch":
    print("INFO starting", flush=True)
    print(f"ValueError: Model architectures {json.loads(config.read_text())['architectures']} are not supported")
    sys.exit(1)
# An engine process, as vLLM starts them: a child in the server's session, naming the model.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", args.model])


class Handler(http.server.BaseHTTPRequestHandler):
    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({"data": [{"id": args.model}]} if self.path == "/v1/models" else {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._json({"choices": [{"token_ids": [7] * body["max_tokens"]}]})

    def log_message(self, *a):
        pass


http.server.HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
