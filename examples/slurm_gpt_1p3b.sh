#!/bin/bash
# GPT 1.3B on 2 nodes x 8 GPUs with Slurm: tensor parallel 2 x pipeline parallel 2 x data parallel 4,
# bf16, the distributed optimizer, checkpoints every 500 iterations (resumed from automatically).
#
#   sbatch examples/slurm_gpt_1p3b.sh
#
# One torchrun per node (srun starts them); torchrun starts the 8 ranks of its node. The first node
# hosts the rendezvous. Each node needs omnitron installed and the data under the same path.
#SBATCH --job-name=omnitron-1p3b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
SAVE=${SAVE:-$PWD/runs/gpt_1p3b}
DATA=${DATA:-data/corpus_text_document}   # omnitron preprocess ... --output-prefix data/corpus

export OMNITRON_BACKEND=${OMNITRON_BACKEND:-cuda}

srun torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node 8 \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id "$SLURM_JOB_ID" \
    -m omnitron.train \
    --model gpt_1p3b --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
    --micro-batch-size 4 --global-batch-size 256 --train-iters 20000 \
    --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 500 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --data-path "$DATA" --split 989,10,1 --eval-interval 1000 --eval-iters 10 \
    --save "$SAVE" --load "$SAVE" --save-interval 500 --ckpt-format torch_dist --async-save \
    --log-interval 10 --log-throughput --tensorboard-dir "$SAVE/tensorboard"
