"""Calibration, what `harness calibrate` runs: measure this machine into a hardware profile the step-time model
prices layouts on. node.py measures one node (GEMMs at the model's shapes, memory bandwidth, a forward + backward,
host copies, CPU Adam, NVMe) and writes the profile; comm.py times the collectives per group size on the real
backend, engine.py a real DeepSpeed step per ZeRO stage on every rank at once, hooks.py turns those steps into the
ZeRO hook overhead; link.py measures the network between nodes (`--link`) and merges it into a node's profile.
Not pure: it starts ranks and touches the device. Nothing but commands/calibrate.py uses it.

May import: the ground floor, config/, planner/, profiling/."""
