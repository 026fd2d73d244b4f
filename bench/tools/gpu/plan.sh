# Sourced: the issue-14 HTTP plan (docs/performance.md, 8cb0990's plan) as S, and
# wait_up PORT LOG (polls /v1/models for up to 300 s; prints the log's tail if it never answers).
# RATES (default 2,8,14,20,26) and TEMPS (default 0) narrow or widen it. In process, a throwaway
# engine serves the burn-in first (~40 s more a call): on two of four freshly started H200s
# (86dff23, 61fca9e) the first mode's ITL p50 at 14-20 req/s was 20-60 % above its own later.
S="--sweep --profiles hetero --temperatures ${TEMPS:-0} --rates ${RATES:-2,8,14,20,26} --run-seconds 12 --num-requests 400 --num-kv-blocks 16384 --slo-ttft-ms 300 --slo-tpot-ms 15 --model dummy:qwen2.5-7b --burn-in-s 20 --throwaway-engine"
wait_up() {
  for i in $(seq 1 300); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/v1/models', timeout=2)" \
      2>/dev/null && { echo "up on $1 after ${i}s"; return 0; }
    sleep 1
  done
  echo "server on $1 not up"; tail -n 40 "$2"; return 1
}
