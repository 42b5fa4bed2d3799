"""The prepared device check runs end to end (here on the CPU) and prints one JSON with its verdicts."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_prints_one_json_with_identity_and_speed():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--modes", "eager",
                           "--drafters", "mtp1,dspark", "--prompts", "2", "--tokens", "12"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["identical"] is True
    arms = out["arms"]["eager"]
    assert arms["dspark"]["identical"] and arms["mtp1"]["identical"]
    assert arms["plain_tokens_per_s"] > 0 and arms["dspark"]["x_plain"] > 0
    assert [pt["batch_tokens"] for pt in arms["sps"]] == [1, 8, 32, 128]
    assert out["tp2"] == {"skipped": "one device"}
