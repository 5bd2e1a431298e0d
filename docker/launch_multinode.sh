#!/usr/bin/env bash
# Start this node's ranks of a multi-node dsharness run on a cluster WITHOUT ssh between nodes.
# Run it on every node at about the same time (each with its own NODE_RANK); all nodes meet at
# MASTER_ADDR:MASTER_PORT, which must be node 0's address, reachable from every node.
#
#   node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 HOSTFILE=/job/hostfile docker/launch_multinode.sh --recipe zero3
#   node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 HOSTFILE=/job/hostfile docker/launch_multinode.sh --recipe zero3
#
# Arguments go to harness/run.py. Environment:
#   NODE_RANK    this node's line in the hostfile, 0-based (required)
#   MASTER_ADDR  address of node 0 (required)
#   MASTER_PORT  a free TCP port on node 0 (default 29500)
#   HOSTFILE     DeepSpeed hostfile, the same on every node (default: docker/hostfile next to this script);
#                with --no_ssh its names are labels only (unique, never resolved): see hostfile.example
#   DEEPSPEED    the launcher to run (default: `harness launch`, DeepSpeed's `deepspeed` that forwards SIGTERM
#                and SIGUSR1 to every rank and exits with their code, 75 when preempted)
#   DS_LAUNCHER_ARGS  extra launcher flags, e.g. "--bind_cores_to_rank"
# Every node needs the same code, data paths and --output-dir (shared storage for checkpoints).
#
# With passwordless ssh between nodes (and pdsh installed, as in the image), one command on node 0
# starts every node instead; the hostfile names must then resolve and accept ssh, and environment
# variables reach the other nodes only through ~/.deepspeed_env (lines NAME=value, e.g. NCCL_SOCKET_IFNAME=eth0):
#   deepspeed --hostfile /job/hostfile --master_addr node-a --master_port 29500 harness/run.py --recipe zero3
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK: the 0-based line of this node in the hostfile (0 on the MASTER_ADDR node)}"
: "${MASTER_ADDR:?set MASTER_ADDR: the address of node 0, reachable from every node}"
MASTER_PORT="${MASTER_PORT:-29500}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${HOSTFILE:-$ROOT/docker/hostfile}"
DEEPSPEED="${DEEPSPEED:-harness launch}"

if [[ ! -f "$HOSTFILE" ]]; then
    echo "error: hostfile $HOSTFILE not found (set HOSTFILE; format: docker/hostfile.example)" >&2
    exit 2
fi

cd "$ROOT"
# shellcheck disable=SC2086  # DEEPSPEED and DS_LAUNCHER_ARGS are lists of words
exec $DEEPSPEED --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" ${DS_LAUNCHER_ARGS:-} \
    harness/run.py "$@"
