#!/usr/bin/env bash
# Work longer than one command on a GPU machine that ends each command at its time limit and keeps /tmp only while
# commands keep coming: a queue started in its own process session outlives the command that starts it.
#
#   bash tools/gpu/queue.sh start 'STAGES'   copy this checkout to $QUEUE_DIR/repo (the kits and wheels left behind) and
#                                            run `bash -c STAGES` there in its own process session, OUT=$QUEUE_DIR/out
#   bash tools/gpu/queue.sh poll [SECONDS]   wait up to SECONDS (default 540) for the queue to end, print its log's tail,
#                                            and pack the log and $QUEUE_DIR/out into $OUT/queue.tgz: one file, since a
#                                            command returns only a few
#
# STAGES is a shell line run from the copy's root, e.g. `LEN=8192 STEPS=2 MODES="bf16 jetrl" bash tools/gpu/gpu_e2e.sh
# setup warm e2e`; the environment of the command that starts it (the vLLM kit's, PYTHONPATH) carries over. The queue
# ends by writing its exit status to $QUEUE_DIR/status; a poll that finds it prints `queue: done, exit N`, one that
# runs out of time `queue: running` (poll again from the next command, within the machine's idle limit). Environment:
# QUEUE_DIR (default /tmp/q), OUT (where poll packs; the device tool's $OUT).
set -uo pipefail
case ${1:-} in -h|--help|"") sed -n '2,/^set -/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
Q=${QUEUE_DIR:-/tmp/q}
case $1 in
  start)
    [ $# -eq 2 ] || { echo "usage: bash tools/gpu/queue.sh start 'STAGES'"; exit 2; }
    [ -f "$Q/status" ] || [ ! -f "$Q/log" ] || { echo "queue: one is running in $Q (poll it, or remove $Q)"; exit 2; }
    rm -rf "$Q" && mkdir -p "$Q/repo" "$Q/out"
    tar --exclude=./.kits --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C "$Q/repo"
    printf '%s\n' "$2" >"$Q/stages"
    (cd "$Q/repo" && OUT="$Q/out" exec setsid nohup bash -c "bash $Q/stages; echo \$? >$Q/status") >"$Q/log" 2>&1 </dev/null &
    sleep 2
    echo "queue: started in $Q: $2"
    tail -5 "$Q/log" ;;
  poll)
    [ -d "$Q" ] || { echo "queue: none in $Q (start one first)"; exit 2; }
    t0=$(date +%s)
    while [ ! -f "$Q/status" ] && [ $(( $(date +%s) - t0 )) -lt "${2:-540}" ]; do sleep 3; done
    tail -30 "$Q/log"
    if [ -f "$Q/status" ]; then echo "queue: done, exit $(cat "$Q/status")"; else echo "queue: running"; fi
    if [ -n "${OUT:-}" ]; then
      mkdir -p "$OUT" && tar czf "$OUT/queue.tgz" -C "$Q" out log stages && echo "queue: $OUT/queue.tgz"
    fi ;;
  *) echo "usage: bash tools/gpu/queue.sh start 'STAGES' | poll [SECONDS]"; exit 2 ;;
esac
