"""CLI subcommands of ``kvtier``; each module registers one subcommand (see ``kvtier.cli``).

CLI glue only: a module parses its arguments and calls what does the work (the benchmarks and
probes live in ``kvtier.bench``). Main thread.
"""
