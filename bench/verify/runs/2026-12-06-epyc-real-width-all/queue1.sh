#!/bin/sh
# The queue as run (binary copied out of target/ so builds cannot replace it mid-run).
B=/tmp/rw/ditmem-new
ME=memory-efficient
V5="fp32/none/$ME,bf16-mixed/none/$ME,bf16-mixed/all/$ME,fp16-mixed/none/$ME,bf16-pure/none/$ME"
./run.sh $B sd3.5-large 128 6 "$V5"
./run.sh $B flux.1-dev 128 10 "$V5" --text-tokens 77,64
./run.sh $B wan2.1-14b 128 10 "$V5" --frames 1 --text-tokens 64
