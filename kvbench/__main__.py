"""``python -m kvbench COMMAND ...``: a thin dispatcher over the command table (:mod:`kvbench.sweep.commands`); a
command with a Hydra config goes through :mod:`kvbench.cli`, the others parse their own arguments."""

from __future__ import annotations

import sys

from kvbench.sweep.commands import COMMANDS, function


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<10} {c.help}" for name, c in COMMANDS.items()]
        msg = "usage: python -m kvbench {" + ",".join(COMMANDS) + "} ...\n\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown subcommand {argv[0]!r}\n{msg}", file=sys.stderr)
            return 2
        print(msg)
        return 0
    command = COMMANDS[argv[0]]
    if command.config is None:
        rc = function(command.main)(argv[1:])
    else:
        from kvbench.cli import main as hydra_command

        rc = hydra_command(command.name, argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
