#!/usr/bin/env python3
"""The prefill side's bootstrap server, as vLLM's MooncakeConnector runs one: prefill workers
register where they are (engine id, dp/tp/pp rank, the TransferEngine session name and their KV
region's layout); decode workers query it when they meet a new engine.

    POST /register  {"engine_id", "dp_rank", "tp_rank", "pp_rank", "session", "kv_base",
                     "layers", "blocks", "block_bytes"}  -> {"status": "ok"}
    GET  /query     -> {dp_rank: {"engine_id": ..., "workers": {tp_rank: {pp_rank: {...}}}}}

Registering is idempotent (a worker repeats it every half second, so a restarted server learns
everything again) and a worker that restarted replaces its old entry; another engine id for a
dp rank that has one is refused with 400. Only the standard library.
"""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FIELDS = ("engine_id", "dp_rank", "tp_rank", "pp_rank", "session", "kv_base", "layers", "blocks", "block_bytes")


class Registry:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_dp = {}

    def register(self, r):
        missing = [f for f in FIELDS if f not in r]
        if missing:
            return 400, {"status": "error", "message": f"missing {missing}"}
        dp = str(int(r["dp_rank"]))
        with self.lock:
            entry = self.by_dp.setdefault(dp, {"engine_id": r["engine_id"], "workers": {}})
            if entry["engine_id"] != r["engine_id"]:
                return 400, {"status": "error",
                             "message": f"dp rank {dp} belongs to engine {entry['engine_id']}, not {r['engine_id']}"}
            worker = {k: r[k] for k in FIELDS if k not in ("engine_id", "dp_rank", "tp_rank", "pp_rank")}
            entry["workers"].setdefault(str(int(r["tp_rank"])), {})[str(int(r["pp_rank"]))] = worker
        return 200, {"status": "ok"}

    def query(self):
        with self.lock:
            return json.loads(json.dumps(self.by_dp))


def handler(registry):
    class Handler(BaseHTTPRequestHandler):
        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            if self.path != "/register":
                return self.reply(404, {"status": "error", "message": "unknown path"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except (ValueError, TypeError) as e:
                return self.reply(400, {"status": "error", "message": f"bad JSON: {e}"})
            self.reply(*registry.register(body))

        def do_GET(self):
            if self.path != "/query":
                return self.reply(404, {"status": "error", "message": "unknown path"})
            self.reply(200, registry.query())

        def log_message(self, *args):
            pass

    return Handler


def serve(host, port):
    server = ThreadingHTTPServer((host, port), handler(Registry()))
    server.daemon_threads = True
    return server


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    server = serve(args.host, args.port)
    print(f"bootstrap ready port={server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
