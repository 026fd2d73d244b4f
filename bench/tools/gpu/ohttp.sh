# ohttp.sh TAG LABEL [serve flags]: verifypd serve on :8000 (dummy 7B, the plan's KV pool), the
# plan through it with rows labelled LABEL, the server stopped; mixed-<device>-http-TAG-C.json.
# e.g. bash bench/tools/gpu/ohttp.sh fuse50 policy-http-fuse --draft-model dummy:qwen2.5-0.5b \
#        --synthetic-acceptance 0.8 --fuse-decode-backlog-s 0.05
source bench/tools/gpu/setup.sh
source bench/tools/gpu/plan.sh
T=$1; L=$2; shift 2
# A server without --synthetic-acceptance refuses a request's own alpha (400): send none.
ALPHA=--http-alpha; case " $* " in *" --synthetic-acceptance "*) ;; *) ALPHA=--no-http-alpha;; esac
setsid python3 -m verifypd serve --model dummy:qwen2.5-7b --num-kv-blocks 16384 \
  --max-num-seqs 64 --max-model-len 4096 --port 8000 "$@" > /tmp/ours-$T.log 2>&1 &
wait_up 8000 /tmp/ours-$T.log || { cp /tmp/ours-$T.log "$OUT"/; exit 1; }
timeout ${WALL:-300} python3 bench/mixed.py $S --http http://127.0.0.1:8000 --mode-label $L \
  $ALPHA --out "$OUT" --tag http-$T-$C
pkill -f "verifypd serve"; sleep 3
# With --log-request-timing: the server's log beside the result (bench/request_times.py reads it).
if grep -q "request timing" /tmp/ours-$T.log; then
  gzip -c /tmp/ours-$T.log > "$OUT/server-log-http-$T-$C.txt.gz"
fi
