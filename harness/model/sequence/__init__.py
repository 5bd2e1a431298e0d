"""Long context: Ulysses sequence parallelism (DeepSpeed ALST) with exact gradients, the harness's document-masked
attention, and tiled MLP / loss.

attention.py: the attention implementations a recipe may name (train.attention) and the harness's
`document_sdpa` (block-causal mask from the gathered, per-document position ids). ulysses.py: the SP process
groups (once per process), each micro-batch's sequence shard. loss.py: the loss as summed token losses over the
replica's count of loss-carrying tokens, no differentiable collective, the per-ZeRO-stage engine factor undone;
the tiled lm_head + cross-entropy. tiling.py: DeepSpeed's TiledMLP on the decoder MLPs. rules.py: the refusals.
"""
