"""Recipe -> schema -> rules -> resolved DeepSpeed dict. Pure: imports neither torch nor the DeepSpeed engine,
so every check runs before any rank starts (and on a laptop).

May import: the ground floor."""
