"""Recipe -> schema -> rules -> resolved DeepSpeed dict. Pure: imports neither torch nor the DeepSpeed engine,
so every check runs before any rank starts (and on a laptop). defaults.py holds every default the planner and the
run share, once; moe_families.py the MoE family table both read.

May import: the ground floor."""
