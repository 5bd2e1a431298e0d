"""Data: which corpus a recipe names and its checks before any rank starts, the formats that turn records into tokens
and loss masks, the memory-mapped token store, rows, and the batch plan (which rows a rank trains on at each step); a mixture of sources (train.datasets) and
its blend index.

May import: the ground floor, config/, planner/."""
