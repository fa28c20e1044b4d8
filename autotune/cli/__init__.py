"""`autotune`: the command line (a contract: README, "Commands").

Bad input exits with code 2 and one line naming the field and the rule; with --json
stdout holds exactly one JSON document and everything else goes to stderr.
"""


from __future__ import annotations

import os
import sys

from autotune.cli.estimate import add_estimate_parser
from autotune.cli.export import add_export_parser
from autotune.cli.models import add_models_parser
from autotune.cli.options import Parser
from autotune.cli.sweep import add_report_parser, add_run_parser, add_worker_parser
from autotune.cli.trial import add_trial_parser
from autotune.errors import UsageError


def build_parser() -> Parser:
    parser = Parser(prog="autotune", description="Profiler-driven autotuner for the parallel layout of "
                                                  "LLM training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (add_trial_parser, add_run_parser, add_worker_parser, add_models_parser, add_report_parser,
                add_estimate_parser, add_export_parser):
        add(sub)
    return parser


# The exit status when the reader of our output left: 1, as rich's console exits when it
# meets a closed pipe, so a table and a JSON document end the same way.
CLOSED_PIPE_STATUS = 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"autotune {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`autotune estimate ... | head`): stop quietly, as Unix tools do.
        # stdout goes to /dev/null so that Python's flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE_STATUS

