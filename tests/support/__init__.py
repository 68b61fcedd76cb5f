"""Test support: builders, launchers, fakes and tolerances shared by the tests (not part of the package)."""
