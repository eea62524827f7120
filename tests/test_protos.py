"""The committed gRPC stubs are what scripts/gen_protos.sh makes of protos/blockspec.proto."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_are_current(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)], check=True)
    for name in ("blockspec_pb2.py", "blockspec_pb2.pyi", "blockspec_pb2_grpc.py"):
        fresh = (tmp_path / "protos" / name).read_text()
        assert fresh == (ROOT / "protos" / name).read_text(), (
            f"rerun scripts/gen_protos.sh ({name})"
        )
