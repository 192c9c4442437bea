# lead, 11:36 UTC, machine quiet after the helpers stopped: Wan 2.1 14B, 3 variants, nice 5, merged main binary
NICE=5 ./run.sh /tmp/ditmem-wan wan2.1-14b 64 14 "fp32/none/memory-efficient,bf16-mixed/none/memory-efficient,bf16-mixed/all/memory-efficient" --frames 1 --text-tokens 16
