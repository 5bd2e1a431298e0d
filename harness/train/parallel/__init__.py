"""Model parallelism the engine does not do on an unmodified HF model: pipeline stages, tensor-parallel layers."""
