"""The committed reference numbers are the exact laws of their instances (docs/verification.md §12).

tests/reference/reference_numbers.json holds the exact one-iteration laws that the law tests
(test_reference_laws.py, test_facts.py) test the verifiers' samples against. Here
``tests/reference_laws.py --check`` recomputes all of them from
tests/reference/reference_instances.json by enumeration (no sampling; a few seconds), and the
toy instance's E[τ] in rational arithmetic against the fractions ``blockspec demo`` prints;
every recomputed law must also be lossless.
"""

from __future__ import annotations

import json

import reference_laws
from harness import REFERENCE_DIR


def test_committed_numbers_are_recomputed_by_enumeration(capsys):
    code = reference_laws.main(["--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all match" in out


def test_check_fails_on_a_changed_number(tmp_path, capsys):
    numbers = json.loads((REFERENCE_DIR / "reference_numbers.json").read_text())
    law = numbers["numbers"]["R1-random-s101"]["K=2"]["Traversal"]["output_law"]
    seq = next(iter(law))
    law[seq] += 1e-8  # 10x the tolerance
    changed = tmp_path / "numbers.json"
    changed.write_text(json.dumps(numbers))
    assert reference_laws.main(["--check", "--numbers", str(changed)]) == 1
    assert f"R1-random-s101 K=2 Traversal output '{seq}'" in capsys.readouterr().out


def test_check_fails_on_a_lossy_rule(monkeypatch):
    # Token verification recovering from p instead of norm((p - q)_+): the classic lossy
    # shortcut. Its law, completed by the target, is off the target's law.
    monkeypatch.setattr(reference_laws, "residual", lambda p_row, q_row, scale=1: list(p_row))
    instances = json.loads((REFERENCE_DIR / "reference_instances.json").read_text())
    inst = reference_laws.Instance(instances["toy"])
    law = reference_laws.METHODS["TV"](inst, 1)
    assert reference_laws.lossless_error(inst, 1, "TV", law) > 1e-2
