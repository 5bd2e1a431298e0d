"""Building a model by share: each rank materialises only the tensors it owns, in the dtype it trains in.

The sequence, one function per step (pipeline, tp and 3d; model/build.py and parallel/pipe_engine.py):
  1. meta.build_on_meta(config)      the whole HF model with parameters on the meta device (no bytes); buffers
                                     (rotary inv_freq) are real, computed at construction, so nothing is recomputed
  2. split on meta                   tensor.shard_model / the PipelineModule's stage (DeepSpeed builds only its layers)
  3. materialise(module, ...)        read this rank's tensors or row/column slices from the checkpoint (source.py),
                                     cast to the training dtype as read, tied weights assigned once per holder
  4. (adapters would be applied here, on the materialised stage or shard)
  5. deepspeed.initialize            the engine
DDP and ZeRO-1/2/3 load through transformers' from_pretrained in the training dtype (ZeRO-3 under zero.Init).
The whole HF model object is dropped once the stage or shard exists: callers keep a ModelInfo (meta.py).
"""
