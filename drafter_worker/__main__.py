"""`python -m drafter_worker`: one drafter tier in this process."""

import sys

from drafter_worker.main import start_drafter
from drafter_worker.settings import DrafterSettings
from protos.tier import tier_main

sys.exit(tier_main(None, DrafterSettings, start_drafter, "python -m drafter_worker"))
