"""`python -m blockspec.loadtest`: see loadtest/cli.py."""

from blockspec.loadtest.cli import main

main()
