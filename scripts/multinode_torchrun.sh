#!/usr/bin/env bash
# Multi-node training without a scheduler: run this on every node, with the same MASTER_ADDR and NNODES
# and each node's own NODE_RANK (0 on the node at MASTER_ADDR, which hosts the rendezvous).
#
#   node 0:  MASTER_ADDR=node0 NNODES=2 NODE_RANK=0 scripts/multinode_torchrun.sh configs/falcon-40b-16gpu.yaml
#   node 1:  MASTER_ADDR=node0 NNODES=2 NODE_RANK=1 scripts/multinode_torchrun.sh configs/falcon-40b-16gpu.yaml
#
# The static rendezvous gives node NODE_RANK the global ranks NODE_RANK*GPUS_PER_NODE ... +GPUS_PER_NODE-1.
# NCCL settings: see scripts/slurm_train.sbatch (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...); export them first.
set -euo pipefail

CONFIG=${1:?usage: MASTER_ADDR=HOST NNODES=N NODE_RANK=I scripts/multinode_torchrun.sh CONFIG.yaml [llamatron train flags]}
shift
: "${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of node 0}"
: "${NODE_RANK:?set NODE_RANK to the index of this node, 0 .. NNODES-1}"
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

exec python -m torch.distributed.run \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend static \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --max-restarts 0 \
    -m llamatron train --config "$CONFIG" "$@"
