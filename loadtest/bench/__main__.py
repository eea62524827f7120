"""`python -m blockspec.loadtest.bench`: see loadtest/bench/cli.py."""

from blockspec.loadtest.bench.cli import main

main()
