"""The shipped conformance suite, collected from ``ttt.testing`` (the same tests that
``pytest --pyargs ttt.testing --ttt-backend NAME`` runs)."""

from ttt.testing.test_against_oracle import *  # noqa: F403
from ttt.testing.test_bad_inputs import *  # noqa: F403
from ttt.testing.test_decode import *  # noqa: F403
from ttt.testing.test_empty_and_meta import *  # noqa: F403
from ttt.testing.test_eta_key_and_outputs import *  # noqa: F403
from ttt.testing.test_fresh_outputs import *  # noqa: F403
from ttt.testing.test_layer import *  # noqa: F403
from ttt.testing.test_properties import *  # noqa: F403
from ttt.testing.test_pytorch_integration import *  # noqa: F403
