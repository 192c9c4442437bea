# lead: after queue4 (Wan 14B), FLUX.1-schnell and the diffusers DiT-XL/2 512, same conditions as queue4
while pgrep -f queue4.sh > /dev/null; do sleep 15; done
NICE=5 ./run.sh /tmp/ditmem-wan flux.1-schnell 64 10 "fp32/none/memory-efficient,bf16-mixed/none/memory-efficient,bf16-mixed/all/memory-efficient" --text-tokens 77,16
NICE=5 ./run.sh /tmp/ditmem-wan dit-xl-2-512 128 4 "fp32/none/memory-efficient,bf16-mixed/none/memory-efficient,bf16-mixed/all/memory-efficient"
