#!/bin/sh
# After queue2: the compare refused for memory at 10:29, rerun alone.
while pgrep -f queue2.sh > /dev/null; do sleep 15; done
echo "$(date -u +%T) sd3.5-large compare (rerun) start; load $(cut -d' ' -f1-3 /proc/loadavg); available $(free -m | awk '/^Mem:/ {print $7}') MiB" >> load.log
nice -n 15 /usr/bin/time -v /tmp/rw/ditmem-final compare --preset sd3.5-large --depth 1 --resolution 128 --batch 1 --steps 1 --json \
    > compare-sd3.5-large-d1-r128.json 2> compare-sd3.5-large-d1-r128.time
echo "$(date -u +%T) sd3.5-large compare rc $?" >> load.log
