"""dsharness: plan a DeepSpeed strategy, build a validated config, train, and measure against the plan.

Folders by concern, imports only downward: config/ and planner/ are pure; train/ runs one rank; profiling/
hooks the live engine; report/ reads run folders; commands/ is the CLI. run.py and cli.py are the entry points."""
