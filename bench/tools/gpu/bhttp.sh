# bhttp.sh TAG [serve flags]: bench/burst.py through verifypd serve on :8000 (dummy 7B, the
# plan's KV pool; no drafter unless the flags give one), the server stopped;
# burst-<device>-http-TAG-C.json. The same burst in-process: python3 bench/burst.py.
source bench/tools/gpu/setup.sh
source bench/tools/gpu/plan.sh
T=$1; shift
setsid python3 -m verifypd serve --model dummy:qwen2.5-7b --num-kv-blocks 16384 \
  --max-num-seqs 64 --max-model-len 4096 --port 8000 "$@" > /tmp/ours-b$T.log 2>&1 &
wait_up 8000 /tmp/ours-b$T.log || { cp /tmp/ours-b$T.log "$OUT"/; exit 1; }
timeout ${WALL:-200} python3 bench/burst.py --http http://127.0.0.1:8000 --out "$OUT" \
  --tag http-$T-$C
pkill -f "verifypd serve"; sleep 3
