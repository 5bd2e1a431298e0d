"""One module per `harness` subcommand: parse its flags, call the package, map errors to exit codes."""
