# vhttp.sh TAG: vLLM 0.24.0's OpenAI server on :8002 (installed from /root/stash, see
# stash.sh), the same plan through it with rows labelled vllm-http, the server stopped.
source bench/tools/gpu/setup.sh
source bench/tools/gpu/plan.sh
bash /root/stash/assemble.sh || exit 1
python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; import peer_engines; \
print(peer_engines.write_model_dir(None, 'dummy:qwen2.5-7b', Path('/tmp/vm'), tokenizer=True))"
env PYTHONPATH=/root/site VLLM_USE_FLASHINFER_SAMPLER=0 setsid python3 -m \
  vllm.entrypoints.openai.api_server --model /tmp/vm/qwen2.5-7b --load-format dummy \
  --dtype bfloat16 --seed 0 --num-gpu-blocks-override 16384 --max-num-batched-tokens 8192 \
  --block-size 16 --max-num-seqs 64 --max-model-len 4096 --port 8002 > /tmp/vllm.log 2>&1 &
wait_up 8002 /tmp/vllm.log || { cp /tmp/vllm.log "$OUT"/; exit 1; }
timeout ${WALL:-330} python3 bench/mixed.py $S --http http://127.0.0.1:8002 \
  --mode-label vllm-http --no-http-alpha --out "$OUT" --tag http-vllm-$1-$C
pkill -f vllm.entrypoints; sleep 3
