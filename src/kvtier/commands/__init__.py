"""CLI subcommands of ``kvtier``; each module registers one subcommand (see ``kvtier.cli``)."""
