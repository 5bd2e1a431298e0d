"""`harness plan` run in this process, for tests that read what it prints."""

from harness.commands import plan as plan_cmd


def run_plan(argv, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    code = plan_cmd.run(parser.parse_args(argv))
    return code, capsys.readouterr().out
