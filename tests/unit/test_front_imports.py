"""The fronts and the routing core load without torch: the front model's stub, the OpenAI
frontend and every settings parser import the engine's shared modules (outputs, config,
protocol, sequence), which import torch only where a tensor or dtype is made (torch alone takes
over a second to import here, in every such process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_fronts_and_the_routing_core_do_not_load_torch():
    code = (
        "import sys; import backend.triton.front_model, backend.openai.router, backend.serving.routing, "
        "backend.engine.config, backend.launch.deployment; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "a front or the routing core imports torch at module level"
