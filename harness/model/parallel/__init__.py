"""Model conversions for parallel layouts DeepSpeed does not do on a Hugging Face model by itself.

tensor.py: Megatron-style tensor parallelism of Llama-family decoder layers over a process group (the `tp`
recipe, and the layers inside pipeline stages for 3D). pipeline.py: HF causal LM -> PipelineModule;
pipe_engine.py: the PipelineEngine in the trainer (pipeline and 3D). Exporting their checkpoints is checkpoint/export/'s.
"""
