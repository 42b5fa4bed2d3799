"""`python -m verifier_worker`: one verifier tier in this process."""

import sys

from protos.tier import tier_main
from verifier_worker.main import start_verifier
from verifier_worker.settings import VerifierSettings

sys.exit(tier_main(None, VerifierSettings, start_verifier, "python -m verifier_worker"))
