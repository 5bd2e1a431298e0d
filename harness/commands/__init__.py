"""One module per `harness` subcommand: parse its flags, call the package, map errors to exit codes.

May import: every room below it (all but the entry points run.py and cli.py): the ground floor, config/,
planner/, data/, model/, checkpoint/, profiling/, calibration/, trackers/, train/, report/."""
