#!/bin/sh
# The second queue as run (time left: Flux at 64², 16 T5 tokens, 3 variants).
B=/tmp/rw/ditmem-new
ME=memory-efficient
./run.sh $B flux.1-dev 64 10 "fp32/none/$ME,bf16-mixed/none/$ME,bf16-mixed/all/$ME" --text-tokens 77,16
