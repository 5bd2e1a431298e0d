"""Checkpoints: save and load through the engine with a manifest (atomic, `latest`, retention), resume on any world
size through the universal form, and export to Hugging Face folders and peft adapters, streamed (export/).

May import: the ground floor, config/, planner/, data/, model/."""
