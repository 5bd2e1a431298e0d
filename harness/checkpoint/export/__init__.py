"""Checkpoints -> Hugging Face folders, streamed in bounded memory (`harness export`).

folder.py: the export itself (meta-model names, shard plan, logits check, staging folder moved into place);
ckpt_tensors.py: lazy per-tensor readers over memory-mapped rank files (ZeRO-0/1/2/3, tensor-parallel ranks);
pipeline.py: the same over pipeline / 3D per-layer files; hf_shards.py: save_pretrained's shard plan and
writer; lora.py: peft adapter folders and the merged model (W + scale B A) as a step in the stream.
"""
