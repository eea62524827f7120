"""blockspec's request path and orchestration."""

import os

# Local Ray clusters listen on 127.0.0.1 only: Ray reads this once, when it is first imported,
# so it is set here, before any module of ours imports ray. Set it to 1 for a real cluster.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
