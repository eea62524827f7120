"""The benchmarks docs pages cite, as subcommands of `blockspec-bench` (loadtest/bench/cli.py)."""
