"""The seed tutorial "Creating Custom ETP Primitives" runs verbatim and prints what it shows.

The script runs in a fresh interpreter: its first cell lists every registered primitive, which
must be exactly the 13 built-ins (other tests register primitives of their own).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BUILTINS = [
    ("etp_conv", True), ("etp_einsum", True), ("etp_elemwise", False), ("etp_emb", True),
    ("etp_emb_v", False), ("etp_gmm", True), ("etp_gmv", False), ("etp_lora_mm", True),
    ("etp_lora_mv", False), ("etp_mm", True), ("etp_mv", False), ("etp_sp_mm", True),
    ("etp_sp_mv", False),
]


def _expected() -> list[str]:
    lines = ["All ETP primitives:"]
    lines += [f"  {name}{' [batched]' if batched else ''}" for name, batched in BUILTINS]
    for title in (
        "Trace propagation rules (ETP_RULES_DT_TO_T):",
        "Weight gradient rules (ETP_RULES_XY_TO_DW):",
        "D-RTRL init rules (ETP_RULES_INIT_DRTRL):",
        "pp_prop init rules (ETP_RULES_INIT_PP):",
    ):
        lines += [title] + [f"  {name}" for name, _ in BUILTINS]
    lines += [
        "Primitive registered: etp_scaled_mm",
        "Type: ETPPrimitive",
        "dt_to_t registered:   True",
        "xy_to_dw registered:  True",
        "init_drtrl registered: True",
        "init_pp registered:   True",
        "Output shape : (4, 5)",
        "Matches 2·xw : True",
        "With bias    : [6.1 6.1 6.1 6.1 6.1]",
        "JIT works: True",
        "Grad shape: (3, 5)",
        "Vmap output shape: (8, 4, 5)",
    ]
    return lines


def test_tutorial_runs_verbatim_with_the_printed_values() -> None:
    script = Path(__file__).with_name("custom_primitive_tutorial.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, check=False, timeout=300
    )
    assert out.returncode == 0, out.stderr
    printed = [line for line in out.stdout.splitlines() if line.strip()]
    assert printed == _expected()
