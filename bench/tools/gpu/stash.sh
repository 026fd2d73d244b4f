# stash.sh DIR K: moves part K of ../shared/vllm/prepare.sh's DIR into /root/stash, one call per
# part while the machine stays warm; vhttp.sh then assembles and installs vLLM from there.
set -e
mkdir -p /root/stash && mv "$1/p$2"/* /root/stash/ && ls /root/stash | wc -l && du -sh /root/stash
