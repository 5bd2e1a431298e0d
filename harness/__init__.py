"""dsharness: plan a DeepSpeed strategy, build a validated config, train, and measure against the plan.

Rooms by concern, lowest first; a module imports only from its own room or a lower one (tests/test_layout.py):
  ground floor   errors.py, log.py, dist.py (process group, exit_now, teardown), ops.py, model_shapes.py
  config/        recipe -> schema -> rules -> resolved DeepSpeed dict (pure)
  planner/       memory, communication and step-time math per layout, hardware profiles, the search (pure)
  data/          corpus files and their checks, formats, the memory-mapped token store, rows, batch plans
  model/         build the model (hub, folder, preset; load/ by share), parallel/ layouts, LoRA adapters
  checkpoint/    save, manifest, resume on any world size, export/ to HF folders
  profiling/     hooks on the live engine: comm per collective, memory per rank, throughput, calibration
  train/         the session (checks before ranks talk), the job, the loop, metrics, preemption
  report/        a run folder -> report.md + plots, measured beside predicted
  commands/      one module per `harness` subcommand
  run.py cli.py  entry points: `deepspeed harness/run.py ...` and the `harness` command
"""
