#!/usr/bin/env bash
# bench_schema_suite.py against a server with dummy weights in a model shape, on a GPU host (docs/benchmarks.md).
#
#   benchmarks/run_gpu_schema_suite.sh CONFIG_JSON TOKENIZER_DIR OUT_DIR [bench_schema_suite.py args ...]
#
# Starts `gramserve serve` on port 30000, waits for /health (up to 15 min: kernels compile at start-up), runs the
# benchmark, stops the server. The server log goes to OUT_DIR/server.log, its /get_server_info at the end to
# OUT_DIR/server_info.json. A tokenizer without a chat template
# (the shapes' configs are served with a borrowed tokenizer) gets benchmarks/templates/chatml.jinja. SERVER_ARGS (an
# environment variable, split on spaces) adds server flags, e.g. SERVER_ARGS="--grammar-shards 2".
set -u
config=$1 tokenizer=$2 out=$3
shift 3
mkdir -p "$out"
template=()
if ! grep -qs '"chat_template"' "$tokenizer/tokenizer_config.json"; then
  template=(--chat-template "$(dirname "$0")/templates/chatml.jinja")
fi
start=$(date +%s)
python -m gramserve serve --model-path "$config" --load-format dummy --tokenizer "$tokenizer" "${template[@]}" \
  --host 127.0.0.1 --port 30000 ${SERVER_ARGS:-} >"$out/server.log" 2>&1 &
server=$!
python - "$server" <<'PY' || { tail -30 "$out/server.log"; kill $server; exit 1; }
import os, sys, time, urllib.request
server, deadline = int(sys.argv[1]), time.time() + 900
while time.time() < deadline:
    try:
        os.kill(server, 0)  # the server exited: stop waiting
    except ProcessLookupError:
        raise SystemExit(1)
    try:
        if urllib.request.urlopen("http://127.0.0.1:30000/health", timeout=5).status == 200:
            raise SystemExit(0)
    except OSError:
        pass
    time.sleep(1)
raise SystemExit(1)
PY
echo "server ready after $(($(date +%s) - start)) s"
python benchmarks/bench_schema_suite.py --base-url http://127.0.0.1:30000 --output-dir "$out" "$@"
status=$?
python -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:30000/get_server_info').read().decode())" \
  >"$out/server_info.json"
kill $server
wait $server
exit $status
