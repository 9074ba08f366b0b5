#!/usr/bin/env bash
# Launch an mtrain recipe on several 8-GPU nodes. Run the same line on every node:
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0 address> scripts/launch_multinode.sh RECIPE [--set k=v ...]
# The hierarchical ring's inner ring is one node (LOCAL_WORLD_SIZE = GPUs per node, under the default
# parallel.hierarchy auto; parallel.node_size overrides it), the outer ring spans nodes.
set -euo pipefail
RECIPE=${1:?usage: NNODES=N NODE_RANK=R MASTER_ADDR=HOST $0 RECIPE [--set k=v ...]}
shift
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
exec accelerate launch \
  --config_file configs/accelerate/multinode.yaml \
  --num_machines "$NNODES" --machine_rank "$NODE_RANK" \
  --num_processes $((NNODES * GPUS_PER_NODE)) \
  --main_process_ip "$MASTER_ADDR" --main_process_port "${MASTER_PORT:-29500}" \
  recipes/train.py "$RECIPE" "$@"
