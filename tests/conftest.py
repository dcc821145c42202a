import os
import sys
from pathlib import Path

# The Triton interpreter must be chosen before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests mirror the package (tests/shard/, tests/units/, ...); what they share lives in
# helpers (tests/_*.py: models, loops, references), imported by name (`from _tp import build`),
# here and in the ranks of a local world (its fork server takes sys.path). No test module imports
# another (tests/test_layers.py checks it).
TESTS = Path(__file__).resolve().parent
FOLDERS = ["shard", "units", "owners", "optim", "checkpoint", "kernels", "integration"]
# examples/lion.py (docs/extending.md's optimizer) is imported by name as well, by the page's block
# and its test, and in the ranks: on the path before the first local world's fork server starts.
EXAMPLES = TESTS.parent / "examples"
for folder in [TESTS, *(TESTS / name for name in FOLDERS), EXAMPLES]:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import pytest  # noqa: E402
from _world import WorldPool  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="module")
def world():
    """`world(n)` returns this module's persistent n-rank gloo world."""
    pool = WorldPool()
    yield pool
    pool.close()
