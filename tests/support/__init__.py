"""Test support (not part of the package): what more than one test file needs, written once.

* ``tests.support.numerics``: tolerances derived from the dtype and the size of the computation;
* ``tests.support.models``: the tiny models and task tests build (the builders are areal_mega/demo/'s);
* ``tests.support.launch``: torchrun commands and runs, the SGLang skip guard.

The deterministic SGLang stand-in is ``areal_mega.inference.fake_server`` (the benchmarks in
tools/ use it too).

``tests/conftest.py`` holds the pytest side (the ``slow`` tier, the process audit). Scripts under
tests/dist/ run with the repository root on PYTHONPATH and import these modules too.
"""
