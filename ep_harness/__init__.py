"""ep_harness from a checkout (PYTHONPATH=<checkout>, or run from its root): the harness/ folder
is the package and reference/ and reports/ its subpackages, the layout the wheel installs
(pyproject.toml's package-dir; docs/namespace.md). An installed copy never runs this file.

It loads harness/__init__.py as ep_harness in its own place in sys.modules, so every module of
the harness has one name and one file, whichever way it was reached."""
import importlib.util
import os
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ep_harness's subpackages that are folders beside harness/, not in it (ep_harness.suites, an
# install's package data, is not one: in a checkout ep_harness.cases reads cases/ itself)
SIBLINGS = {f"{__name__}.reference": "reference", f"{__name__}.reports": "reports"}


class _SiblingFinder:
    """Finds ep_harness.reference and ep_harness.reports in the checkout's folders. First on
    sys.meta_path: an editable install of another checkout must not supply them."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        folder = SIBLINGS.get(name)
        if folder is None:
            return None
        init = os.path.join(CHECKOUT, folder, "__init__.py")
        return importlib.util.spec_from_file_location(name, init,
                                                      submodule_search_locations=[os.path.dirname(init)])


if _SiblingFinder not in sys.meta_path:
    sys.meta_path.insert(0, _SiblingFinder)
_package = os.path.join(CHECKOUT, "harness")
_spec = importlib.util.spec_from_file_location(__name__, os.path.join(_package, "__init__.py"),
                                               submodule_search_locations=[_package])
_module = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _module  # the import system hands out what sys.modules holds after this file
_spec.loader.exec_module(_module)
