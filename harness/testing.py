"""The pytest helpers, from a public place: `from ep_harness.testing import assert_invariant`.

They live in ep_harness.pytest_plugin (the plugin pytest loads through the `pytest11` entry
point); this module names them for users' tests. The `ep_world` fixture and the `gpus(n)`
marker need no import: installing ep-harness registers the plugin in every pytest session.
pytest itself comes with `pip install 'ep-harness[testing]'`.
"""
from ep_harness.pytest_plugin import RankFailed, World, assert_bitwise_equal, assert_invariant

__all__ = ["RankFailed", "World", "assert_bitwise_equal", "assert_invariant"]
