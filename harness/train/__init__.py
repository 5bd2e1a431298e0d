"""One training job on one rank: session checks, data, model (+ pipeline/TP conversion in train/parallel/),
DeepSpeed engine, train loop, checkpoints, export."""
