"""`blockspec` as a user runs it, in a fresh process from this checkout (the console script
need not be on PATH): `subprocess.run([*BLOCKSPEC, "serve", ...])`."""

import sys

BLOCKSPEC = [sys.executable, "-c", "import sys; from service.cli import main; main(sys.argv[1:])"]
