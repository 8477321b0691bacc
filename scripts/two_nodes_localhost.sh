#!/bin/bash
# Two torch elastic agents on this machine acting as two nodes: what `torchrun --nnodes 2` does
# on a cluster, with the c10d rendezvous on 127.0.0.1 and a free port.
#   bash scripts/two_nodes_localhost.sh NPROC_PER_NODE [dtlab train arguments...]
# The first agent hosts the rendezvous store (is_host=true) and must stay up; the second says
# is_host=false, else it may bind the store port first and the host agent fails (seen here).
set -uo pipefail
nproc=${1:?usage: two_nodes_localhost.sh NPROC_PER_NODE [dtlab train arguments...]}
shift
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
common=(--nnodes 2 --nproc-per-node "$nproc" --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "localhost-$port")
dtlab train "${common[@]}" --rdzv-conf is_host=true "$@" &   # "node 0"
host=$!
dtlab train "${common[@]}" --rdzv-conf is_host=false "$@"    # "node 1"
second=$?
wait "$host"
first=$?
exit $(( first ? first : second ))
